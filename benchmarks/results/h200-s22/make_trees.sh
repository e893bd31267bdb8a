#!/bin/bash
# The trees next.sh measures, made here (the device machine has no git): run from the repository
# root, `bash benchmarks/results/h200-s22/make_trees.sh [commit]` (default HEAD). n-base: that
# commit's src; n-rest20: with candidate-rest.patch (the sweep, while the GPU polls, rests 20 us
# between its looks with the GIL released, kalos.ipc._fence.spin_pending, keeping its core);
# n-rest50: the same resting 50 us; n-sleep: sleeping 20 us instead (probe1's variant, which
# brought recall_text to 1.7 ms and cost the crowd beside the GEMMs); n-watch: with
# candidate-watch.patch instead (the sweep, while the GPU polls, waits with the GIL released
# until the kernels write one of their host words: a round began, took, handed over, answered).
# n-gather: with candidate-gather.patch (session 20's candidate-yield-gather.patch ported onto
# main in session 23: a batch round, past its 20 us window, goes on gathering while requests
# keep coming, each within 10 us of the last, up to 80 us; a GPU-polling sidecar advises its
# crowded clients, past two per core, to spin yielding instead of napping); n-gathernap: the
# same rounds with napping clients (crowded_wait returning "nap"), to tell the two parts apart.
# n-pre3: 978da6a, main before control protocol 3 (session 23: each client rings and is rung
# through a socket pair of its own instead of the shared doorbell and its own eventfd), the
# baseline of that change on the H200.
set -e
here=benchmarks/results/h200-s22
commit=${1:-HEAD}
rm -rf .snap/trees/n-base .snap/trees/n-rest20 .snap/trees/n-rest50 .snap/trees/n-sleep .snap/trees/n-watch \
  .snap/trees/n-gather .snap/trees/n-gathernap .snap/trees/n-pre3
mkdir -p .snap/trees/n-pre3
git archive 978da6a src | tar -x -C .snap/trees/n-pre3
mkdir -p .snap/trees/n-base
git archive "$commit" src tests | tar -x -C .snap/trees/n-base  # (tests: the patches change them too)
for v in rest20 rest50 sleep; do
  cp -r .snap/trees/n-base .snap/trees/n-$v
  (cd .snap/trees/n-$v && patch -s -p1 < ../../../$here/candidate-rest.patch)
done
cp -r .snap/trees/n-base .snap/trees/n-watch
(cd .snap/trees/n-watch && patch -s -p1 < ../../../$here/candidate-watch.patch)
sed -i 's/^_SERVING_REST_S = 20e-6$/_SERVING_REST_S = 50e-6/' .snap/trees/n-rest50/src/kalos/server/recall_loop.py
sed -i 's/channel.rest(_SERVING_REST_S)$/time.sleep(20e-6)/' .snap/trees/n-sleep/src/kalos/server/recall_loop.py
for v in gather gathernap; do
  cp -r .snap/trees/n-base .snap/trees/n-$v
  (cd .snap/trees/n-$v && patch -s -p1 < ../../../$here/candidate-gather.patch)
done
sed -i 's/return "yield" if gpu_polling else "nap"$/return "nap"/' .snap/trees/n-gathernap/src/kalos/server/sidecar.py
grep -q 'return "nap"$' .snap/trees/n-gathernap/src/kalos/server/sidecar.py
grep -q "_SERVING_REST_S = 50e-6" .snap/trees/n-rest50/src/kalos/server/recall_loop.py
grep -q "time.sleep(20e-6)" .snap/trees/n-sleep/src/kalos/server/recall_loop.py
du -sh .snap/trees/n-*
