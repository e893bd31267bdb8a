/* A client written against the seed article's protocol (sections 4.1 and 4.4), used by
 * tests/test_seed_compat.py and tests/seed/bench_seed_compat.py to check that Kalos serves it
 * unchanged. The struct, the init (shm_open O_CREAT 0666 + ftruncate + mmap + memset + magic,
 * version, memory_count) and the handshake (wait done == 0; write query, query_dim;
 * release-store request_id, ready = 1; wait done == 1; read; store done = 0) are the article's.
 * What differs: many random queries instead of one, every answer printed, a deadline on each
 * wait so a broken server fails a test instead of hanging it, and no sleep(1) before the
 * first request (a client that starts first simply waits for done).
 *
 * usage: seed_client N SEED DIM [SHM_NAME] [--dump PATH] [--gap-us US] [--memory-count M]
 *                     [--timeout-s S]
 *   N          requests to send, back to back (request_id 1..N)
 *   SEED       seed of the query generator (splitmix64)
 *   DIM        query_dim to send (<= 1024)
 *   SHM_NAME   segment name, default "/kalos_recall_shm" (the article's SHM_NAME)
 *   --dump     write every query sent, as raw float32[DIM] rows, to PATH
 *   --gap-us   sleep about this long between requests (uniform in [gap/2, 3*gap/2), from
 *              its own generator, so arrivals fall at random phases of the server's sleeps):
 *              measures the pick-up after idle
 *   --memory-count  value written into memory_count at init (default 65536, as the article)
 *   --timeout-s     give up (exit 3) when one wait exceeds this (default 60)
 *
 * stdout, one line per answer:
 *   request_id result_count e2e_ns id[0] .. id[15] score[0] .. score[15]
 * (all 16 slots; scores with %.9g, which round-trips a float).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "seed/shared_recall.h"

static uint64_t g_rng;

static uint64_t splitmix64(void) {
    uint64_t z = (g_rng += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

/* Uniform in [-1, 1), exactly representable as a float (24 random bits). */
static float uniform_pm1(void) {
    return (float)(splitmix64() >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static double g_timeout_s = 60.0;

/* The article's wait: spin with sched_yield until the flag has the wanted value. */
static void wait_flag(uint32_t *flag, uint32_t want_nonzero, const char *what, uint32_t request_id) {
    int64_t deadline = now_ns() + (int64_t)(g_timeout_s * 1e9);
    unsigned spins = 0;
    for (;;) {
        uint32_t v = __atomic_load_n(flag, __ATOMIC_ACQUIRE);
        if (want_nonzero ? v != 0 : v == 0) return;
        sched_yield();
        if ((++spins & 1023) == 0 && now_ns() > deadline) {
            fprintf(stderr, "seed_client: request_id=%u: timed out after %.0f s waiting for %s\n",
                    request_id, g_timeout_s, what);
            exit(3);
        }
    }
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s N SEED DIM [SHM_NAME] [--dump PATH] [--gap-us US] "
                        "[--memory-count M] [--timeout-s S]\n", argv[0]);
        return 2;
    }
    long n_requests = strtol(argv[1], NULL, 10);
    g_rng = strtoull(argv[2], NULL, 10);
    long dim = strtol(argv[3], NULL, 10);
    const char *shm_name = SHM_NAME;
    const char *dump_path = NULL;
    long gap_us = 0;
    uint32_t memory_count = MAX_MEMORY_ITEMS;
    int i = 4;
    if (i < argc && strncmp(argv[i], "--", 2) != 0) shm_name = argv[i++];
    for (; i < argc; i++) {
        if (i + 1 < argc && strcmp(argv[i], "--dump") == 0) dump_path = argv[++i];
        else if (i + 1 < argc && strcmp(argv[i], "--gap-us") == 0) gap_us = strtol(argv[++i], NULL, 10);
        else if (i + 1 < argc && strcmp(argv[i], "--memory-count") == 0) memory_count = (uint32_t)strtoul(argv[++i], NULL, 10);
        else if (i + 1 < argc && strcmp(argv[i], "--timeout-s") == 0) g_timeout_s = strtod(argv[++i], NULL);
        else { fprintf(stderr, "seed_client: unknown argument %s\n", argv[i]); return 2; }
    }
    if (n_requests < 0 || dim < 1 || dim > MAX_QUERY_DIM) {
        fprintf(stderr, "seed_client: need N >= 0 and 1 <= DIM <= %d\n", MAX_QUERY_DIM);
        return 2;
    }

    /* The article's init, step by step. */
    int fd = shm_open(shm_name, O_CREAT | O_RDWR, 0666);
    if (fd < 0) { perror("shm_open"); return 1; }
    if (ftruncate(fd, sizeof(recall_shm_t)) != 0) { perror("ftruncate"); return 1; }
    recall_shm_t *shm = (recall_shm_t *)mmap(NULL, sizeof(recall_shm_t), PROT_READ | PROT_WRITE,
                                             MAP_SHARED, fd, 0);
    if (shm == MAP_FAILED) { perror("mmap"); return 1; }
    memset(shm, 0, sizeof(recall_shm_t));
    shm->magic = 0x4B414C4F; // KALO
    shm->version = 1;
    shm->memory_count = memory_count;
    fprintf(stderr, "seed_client: %s initialised, %ld requests, seed %s, dim %ld\n",
            shm_name, n_requests, argv[2], dim);

    FILE *dump = NULL;
    if (dump_path && !(dump = fopen(dump_path, "wb"))) { perror("fopen --dump"); return 1; }

    float query[MAX_QUERY_DIM];
    uint64_t gap_rng = g_rng ^ 0xA5A5A5A5DEADBEEFULL; /* the gaps' own stream: queries do not depend on them */
    for (long iter = 0; iter < n_requests; iter++) {
        uint32_t request_id = (uint32_t)(iter + 1);
        /* A random query. Two in three are normalised by the client, as in the article; the
         * third is scaled by 2^e, e in [-20, 20], so the server's own normalisation is tested. */
        float norm = 0.0f;
        for (long j = 0; j < dim; j++) {
            query[j] = uniform_pm1();
            norm += query[j] * query[j];
        }
        norm = sqrtf(norm);
        float scale = (iter % 3 == 2) ? ldexpf(1.0f, (int)(splitmix64() % 41) - 20) : 1.0f / norm;
        for (long j = 0; j < dim; j++) query[j] *= scale;
        if (dump && fwrite(query, sizeof(float), (size_t)dim, dump) != (size_t)dim) {
            perror("fwrite --dump");
            return 1;
        }

        // 等待上一个请求处理结束 (wait for the previous request to be consumed)
        wait_flag(&shm->done, 0, "done == 0", request_id);
        int64_t start = now_ns();
        memcpy(shm->query, query, (size_t)dim * sizeof(float));
        shm->query_dim = (uint32_t)dim;
        __atomic_store_n(&shm->request_id, request_id, __ATOMIC_RELEASE);
        __atomic_store_n(&shm->ready, 1, __ATOMIC_RELEASE);
        // 等待结果 (wait for the result)
        wait_flag(&shm->done, 1, "done == 1", request_id);
        int64_t elapsed = now_ns() - start;

        uint32_t count = shm->result_count;
        printf("%u %u %lld", request_id, count, (long long)elapsed);
        for (int k = 0; k < MAX_RESULT_ITEMS; k++) printf(" %d", shm->result_ids[k]);
        for (int k = 0; k < MAX_RESULT_ITEMS; k++) printf(" %.9g", shm->result_scores[k]);
        putchar('\n');
        // 消费完结果后把 done 清 0 (results consumed: clear done for the next round)
        __atomic_store_n(&shm->done, 0, __ATOMIC_RELEASE);

        if (gap_us > 0) {
            gap_rng = gap_rng * 6364136223846793005ULL + 1442695040888963407ULL;
            long us = gap_us / 2 + (long)((gap_rng >> 33) % (uint64_t)gap_us);
            struct timespec gap = {us / 1000000, (us % 1000000) * 1000};
            while (nanosleep(&gap, &gap) != 0 && errno == EINTR) {}
        }
    }
    if (dump && fclose(dump) != 0) { perror("fclose --dump"); return 1; }
    fflush(stdout);
    munmap(shm, sizeof(recall_shm_t));
    close(fd);
    // Like the article: the segment is left in place (no shm_unlink).
    return 0;
}
