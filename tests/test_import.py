"""``kalos import`` and :mod:`kalos.tools.importer`: JSONL, CSV and Parquet, validated whole, batched, resumable.

Against one real 384-dim sidecar (this module's), with real embeddings for rows that carry
only a text. Covered: each format with texts, vectors, metadata (object column and plain
fields) and namespaces; malformed rows reported with their line (row) numbers and *nothing*
imported; resume after an interruption between batches and after one between the sidecar's
commit and the progress write (no row twice, none lost); the progress file refusing a changed
file or an accidental re-import; and the command line (exit codes, messages, summary).
"""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import DEADLINE_S
from test_text import client, minilm, sidecar  # noqa: F401 (the text tests' fixtures, shared)

from kalos import Client, InvalidArgument
from kalos.client.embed import DEFAULT_DIM
from kalos.tools.importer import Columns, ImportValidationError, import_file, progress_path, validate_file

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXTS = [
    "The staging cluster runs in eu-west-1.",
    "Carol is allergic to peanuts.",
    "The build cache is cleared every Sunday night.",
    "Invoices are sent on the first working day of the month.",
    "The VPN certificate expires in June.",
    "Dave's favourite editor is Emacs.",
    "Backups are kept for thirty days.",
]


@pytest.fixture
def ns() -> str:
    return f"i-{uuid.uuid4().hex[:12]}"


def unit(rng: np.random.Generator, n: int) -> np.ndarray:
    m = rng.standard_normal((n, DEFAULT_DIM)).astype(np.float32)
    return m / np.linalg.norm(m, axis=1, keepdims=True)


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    with path.open("w", encoding="utf-8") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return path


def count(client: Client, namespace: str) -> int:
    return client.stats()["namespaces"].get(namespace, 0)


def progress_record(path: Path, client: Client) -> dict[str, Any]:
    """What the progress file of ``path`` records for the store ``client``'s sidecar serves."""
    return json.loads(Path(path).read_text())["imports"][client.stats()["store"]]


def stored_texts(client: Client, namespace: str, n: int = 64) -> list[str]:
    """Every text in ``namespace`` (recalled with a query that ranks them all)."""
    vector = np.ones(DEFAULT_DIM, np.float32)
    hits = client.recall(vector, k=n, namespace=namespace)
    return sorted(item.text for item in client.get(hits.ids))


# -- the formats ------------------------------------------------------------------------------


def test_jsonl_texts_are_embedded_and_recallable(client, ns, tmp_path):
    path = write_jsonl(tmp_path / "notes.jsonl", [
        {"text": t, "metadata": {"n": i}, "namespace": ns} for i, t in enumerate(TEXTS)
    ])
    summary = import_file(client, path, batch=3, progress=None)
    assert (summary.rows, summary.imported, summary.skipped, summary.embedded) == (7, 7, 0, 7)
    assert summary.namespaces == {ns: 7}
    assert stored_texts(client, ns) == sorted(TEXTS)
    [hit] = client.recall_text("Who cannot eat peanuts?", k=1, namespace=ns)
    assert hit.text == TEXTS[1] and hit.metadata == {"n": 1}
    assert progress_record(Path(summary.progress_file), client)["committed"] == 7


def test_jsonl_with_vectors_mixed_namespaces_and_custom_columns(client, ns, tmp_path, rng):
    vectors = unit(rng, 5)
    rows = [{"body": f"memo {i}", "emb": vectors[i].tolist(), "ns": ns if i % 2 else ns + "-odd", "src": "wiki",
             "meta": {"i": i}} for i in range(5)]
    rows.append({"body": "no vector: embedded", "ns": ns, "meta": {"i": 5}})
    path = write_jsonl(tmp_path / "custom.jsonl", rows)
    cols = Columns(text="body", vector="emb", metadata="meta", namespace="ns", metadata_fields=("src",))
    summary = import_file(client, path, columns=cols, batch=4, progress=None)
    assert summary.imported == 6 and summary.embedded == 1
    assert summary.namespaces == {ns: 3, ns + "-odd": 3}
    hit = client.recall(vectors[3], k=1, namespace=ns)
    [item] = client.get(hit.ids)
    assert item.text == "memo 3" and item.metadata == {"i": 3, "src": "wiki"}
    assert float(hit.scores[0]) == pytest.approx(1.0, abs=1e-5)  # stored as given


def test_csv_with_quoted_multiline_texts_and_json_cells(client, ns, tmp_path, rng):
    vec = unit(rng, 1)[0]
    path = tmp_path / "notes.csv"
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["text", "vector", "metadata", "namespace", "author"])
        w.writerow(["first line\nsecond line, with a comma", "", '{"tag": "multi"}', ns, "ann"])
        w.writerow(["has a vector", json.dumps(vec.tolist()), "", ns, "bob"])
        w.writerow([TEXTS[2], "", "", "", "cy"])  # namespace from --namespace
    summary = import_file(client, path, columns=Columns(metadata_fields=("author",)), default_namespace=ns + "-d",
                          progress=None)
    assert summary.imported == 3 and summary.embedded == 2
    assert summary.namespaces == {ns: 2, ns + "-d": 1}
    texts = stored_texts(client, ns)
    assert texts == sorted(["first line\nsecond line, with a comma", "has a vector"])
    [hit] = client.recall_text("When is the build cache emptied?", k=1, namespace=ns + "-d")
    assert hit.text == TEXTS[2] and hit.metadata == {"author": "cy"}


def test_parquet_with_list_vectors_and_struct_metadata(client, ns, tmp_path, rng):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    vectors = unit(rng, 3)
    table = pa.table({
        "text": TEXTS[:3] + [TEXTS[3]],
        "vector": [v.tolist() for v in vectors] + [None],
        "metadata": [{"k": i} for i in range(4)],
        "namespace": [ns] * 4,
    })
    path = tmp_path / "notes.parquet"
    pq.write_table(table, path)
    summary = import_file(client, path, batch=2, progress=None)
    assert summary.imported == 4 and summary.embedded == 1 and summary.namespaces == {ns: 4}
    assert stored_texts(client, ns) == sorted(TEXTS[:4])
    [item] = client.get(client.recall(vectors[1], k=1, namespace=ns).ids)
    assert item.text == TEXTS[1] and item.metadata == {"k": 1}


# -- malformed files: every bad row listed, nothing imported ------------------------------------


def test_malformed_jsonl_rows_are_listed_by_line_and_nothing_is_imported(client, ns, tmp_path, rng):
    good = {"text": "fine", "namespace": ns}
    path = write_jsonl(tmp_path / "bad.jsonl", [
        good,                                               # line 1
        "",                                                 # line 2: blank, skipped
        "{not json",                                        # line 3
        good,                                               # line 4
        {"text": "v", "vector": [1.0, 2.0], "namespace": ns},  # line 5: wrong dimension
        {"metadata": {"a": 1}, "namespace": ns},            # line 6: neither text nor vector
        ["a", "list"],                                      # line 7
        {"text": "x", "namespace": "bad\x00ns"},            # line 8
        {"text": "x", "metadata": "str", "namespace": ns},  # line 9
        {"text": "x", "vector": [0.0] * DEFAULT_DIM},       # line 10: zero vector
        {"text": 5},                                        # line 11
        good,                                               # line 12
    ])
    with pytest.raises(ImportValidationError) as info:
        import_file(client, path, progress=None)
    err = info.value
    assert [where for where, _ in err.errors] == [f"line {n}" for n in (3, 5, 6, 7, 8, 9, 10, 11)]
    assert err.total_errors == 8
    message = str(err)
    assert "8 of 11 rows are malformed; nothing was imported" in message
    assert "line 5: 'vector' has 2 numbers; the store holds dimension 384" in message
    assert "line 10:" in message and "all zeros" in message
    assert count(client, ns) == 0
    assert not progress_path(path).exists()


def test_malformed_csv_rows_report_the_line_where_the_record_starts(client, ns, tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text(
        "text,metadata,namespace\n"                     # line 1
        f'"two\nlines",,{ns}\n'                         # lines 2-3: fine
        f"ok,{{\"a\": 1}},{ns}\n"                       # line 4: fine
        f"too,many,fields,{ns}\n"                       # line 5
        f'"three\nline\ntext","{{broken",{ns}\n'        # lines 6-8: bad metadata JSON
        f"last,,{ns}\n",                                # line 9: fine
        encoding="utf-8",
    )
    with pytest.raises(ImportValidationError) as info:
        import_file(client, path, progress=None)
    assert [where for where, _ in info.value.errors] == ["line 5", "line 6"]
    assert "4 fields where the header has 3" in str(info.value)
    assert "'metadata' is not a JSON object" in str(info.value)
    assert count(client, ns) == 0


def test_malformed_parquet_rows_report_row_numbers(client, ns, tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": ["a", None, "c", ""], "namespace": [ns] * 4}), tmp_path / "bad.parquet")
    with pytest.raises(ImportValidationError) as info:
        import_file(client, tmp_path / "bad.parquet", progress=None)
    assert [where for where, _ in info.value.errors] == ["row 2", "row 4"]
    assert count(client, ns) == 0


def test_a_file_without_the_text_column_is_refused_with_its_columns(client, tmp_path):
    (tmp_path / "x.csv").write_text("body,ns\nhello,a\n")
    with pytest.raises(InvalidArgument, match="its columns: body, ns.*--text-column"):
        validate_file(tmp_path / "x.csv", dim=DEFAULT_DIM)
    (tmp_path / "x.dat").write_text("hello\n")  # (.txt is plain text: one memory per line)
    with pytest.raises(InvalidArgument, match="--format"):
        validate_file(tmp_path / "x.dat", dim=DEFAULT_DIM)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(InvalidArgument, match="holds no rows"):
        validate_file(tmp_path / "empty.jsonl", dim=DEFAULT_DIM)


# -- resume ---------------------------------------------------------------------------------------


class Interrupting:
    """A client whose add is interrupted: ``before`` (nothing sent) or ``after`` (committed) add number ``at``."""

    def __init__(self, client: Client, at: int, when: str) -> None:
        self.client, self.at, self.when, self.adds = client, at, when, 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def add(self, *args: Any, **kwargs: Any) -> np.ndarray:
        self.adds += 1
        if self.adds == self.at and self.when == "before":
            raise KeyboardInterrupt("interrupted before the add")
        ids = self.client.add(*args, **kwargs)
        if self.adds == self.at and self.when == "after":
            raise KeyboardInterrupt("interrupted after the commit, before the progress write")
        return ids


@pytest.mark.parametrize("when", ["before", "after"])
def test_resume_imports_each_row_exactly_once(client, ns, tmp_path, rng, when):
    vectors = unit(rng, 10)
    path = write_jsonl(tmp_path / "ten.jsonl", [
        {"text": f"row {i}", "vector": vectors[i].tolist(), "namespace": ns} for i in range(10)
    ])
    with pytest.raises(KeyboardInterrupt):
        import_file(Interrupting(client, at=3, when=when), path, batch=3, progress=None)
    landed = 9 if when == "after" else 6
    assert count(client, ns) == landed
    record = progress_record(progress_path(path), client)
    assert record["committed"] == 6 and record["rows"] == 10
    assert record["pending"] == {"start": 6, "stop": 9, "namespace": ns, "count_before": 6}

    with pytest.raises(InvalidArgument, match="stopped after 6 of 10 rows.*--resume"):
        import_file(client, path, batch=3, progress=None)
    summary = import_file(client, path, batch=3, resume=True, progress=None)
    assert summary.skipped == (9 if when == "after" else 6)
    assert summary.imported == 10 - summary.skipped
    assert count(client, ns) == 10
    assert stored_texts(client, ns) == sorted(f"row {i}" for i in range(10))

    with pytest.raises(InvalidArgument, match="already imported.*--restart"):
        import_file(client, path, progress=None)
    again = import_file(client, path, restart=True, progress=None)
    assert again.imported == 10 and count(client, ns) == 20


def test_resume_refuses_a_file_that_changed(client, ns, tmp_path, rng):
    vectors = unit(rng, 4)
    rows = [{"text": f"r{i}", "vector": vectors[i].tolist(), "namespace": ns} for i in range(4)]
    path = write_jsonl(tmp_path / "f.jsonl", rows)
    with pytest.raises(KeyboardInterrupt):
        import_file(Interrupting(client, at=2, when="before"), path, batch=2, progress=None)
    write_jsonl(path, rows + rows[:1])
    with pytest.raises(InvalidArgument, match="cannot resume.*another version"):
        import_file(client, path, batch=2, resume=True, progress=None)
    assert count(client, ns) == 2


def test_progress_bar_goes_to_the_stream(client, ns, tmp_path, rng):
    import io

    vectors = unit(rng, 20)
    path = write_jsonl(tmp_path / "p.jsonl", [
        {"text": f"p{i}", "vector": vectors[i].tolist(), "namespace": ns} for i in range(20)
    ])
    stream = io.StringIO()
    import_file(client, path, batch=5, progress=stream)
    final = stream.getvalue().replace("\r", "\n").strip().splitlines()[-1]  # tqdm redraws with \r
    assert "100%" in final and "20/20" in final and "rows/s" in final, final


# -- the command line ------------------------------------------------------------------------------


def kalos(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kalos", *map(str, args)], capture_output=True, text=True,
                          timeout=DEADLINE_S * 3)


def test_cli_import_help_says_nothing_is_imported_on_validation_failure():
    out = kalos("import", "--help")
    assert out.returncode == 0
    for option in ("--text-column", "--vector-column", "--metadata-column", "--metadata-fields",
                   "--namespace-column", "--namespace", "--batch", "--resume", "--restart", "--format"):
        assert option in out.stdout
    assert "NOTHING of the file is imported" in out.stdout and "line number" in out.stdout


def test_cli_import_reports_bad_lines_and_exits_2(sidecar, ns, tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"text": "ok", "namespace": ns}, "{oops", {"vector": "x"}])
    out = kalos("import", path, "--name", sidecar.name)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert out.stderr.startswith("kalos import: error:")
    assert "nothing was imported" in out.stderr and "line 2:" in out.stderr and "line 3:" in out.stderr


def test_cli_import_then_recall_text(sidecar, ns, tmp_path, rng):
    path = write_jsonl(tmp_path / "cli.jsonl", [{"text": t, "namespace": ns} for t in TEXTS])
    out = kalos("import", path, "--name", sidecar.name, "--batch", "4", "--json")
    assert out.returncode == 0, out.stderr
    summary = json.loads(out.stdout)
    assert summary["imported"] == 7 and summary["embedded"] == 7 and summary["namespaces"] == {ns: 7}
    assert "100%" in out.stderr and "7/7" in out.stderr  # the progress bar (tqdm)
    # The model's load: shown while it runs, and timed apart from the import's rate.
    assert "loading the embedder all-MiniLM-L6-v2" in out.stderr and "2/2 steps" in out.stderr, out.stderr
    assert summary["load_seconds"] > 0
    assert summary["rows_per_s"] == pytest.approx(7 / (summary["seconds"] - summary["load_seconds"]))
    out = kalos("recall", "--name", sidecar.name, "--text", "Which editor does Dave use?", "--namespace", ns,
                "-k", "2", "--json")
    assert out.returncode == 0, out.stderr
    hits = json.loads(out.stdout)
    assert len(hits) == 2 and hits[0]["text"] == TEXTS[5]
    out = kalos("import", path, "--name", sidecar.name)
    assert out.returncode == 2 and "already imported" in out.stderr
    # --resume of the finished import: nothing to do, and no model loaded for it.
    out = kalos("import", path, "--name", sidecar.name, "--resume", "--json")
    assert out.returncode == 0, out.stderr
    again = json.loads(out.stdout)
    assert (again["imported"], again["skipped"], again["load_seconds"]) == (0, 7, 0.0)
    assert "loading the embedder" not in out.stderr
    assert count(Client(sidecar.name, timeout=DEADLINE_S), ns) == 7


# -- issue #20: the guard per store, BOM, plain text, the model only when needed ------------------


def test_the_duplicate_guard_remembers_every_store_the_file_went_into(client, ns, tmp_path, rng):
    from kalos.server.launcher import SidecarProcess

    vectors = unit(rng, 4)
    path = write_jsonl(tmp_path / "twice.jsonl", [
        {"text": f"t{i}", "vector": vectors[i].tolist(), "namespace": ns} for i in range(4)
    ])
    assert import_file(client, path, progress=None).imported == 4
    other_name = f"{client.name}-second"
    with SidecarProcess(tmp_path / "second.db", name=other_name, dim=DEFAULT_DIM) as _second, \
            Client(other_name, timeout=DEADLINE_S) as other:
        assert import_file(other, path, progress=None).imported == 4  # another store: imported there
        with pytest.raises(InvalidArgument, match="already imported into"):
            import_file(other, path, progress=None)
    # Back to the first store: it still has the file, whatever happened in between.
    with pytest.raises(InvalidArgument, match="already imported into"):
        import_file(client, path, progress=None)
    assert count(client, ns) == 4


def test_a_version_1_progress_file_still_guards_its_store(client, ns, tmp_path, rng):
    vectors = unit(rng, 2)
    path = write_jsonl(tmp_path / "old.jsonl", [
        {"text": f"o{i}", "vector": vectors[i].tolist(), "namespace": ns} for i in range(2)
    ])
    import_file(client, path, progress=None)
    record = progress_record(progress_path(path), client)
    progress_path(path).write_text(json.dumps({"format": "kalos-import-progress", "version": 1, **record}))
    with pytest.raises(InvalidArgument, match="already imported into"):
        import_file(client, path, progress=None)


def test_a_csv_with_a_utf8_byte_order_mark(client, ns, tmp_path):
    path = tmp_path / "excel.csv"
    with path.open("w", newline="", encoding="utf-8-sig") as f:  # what Excel's "CSV UTF-8" writes
        w = csv.writer(f)
        w.writerow(["text", "namespace"])
        for t in TEXTS[:3]:
            w.writerow([t, ns])
    assert path.read_bytes().startswith(b"\xef\xbb\xbf")
    summary = import_file(client, path, progress=None)
    assert summary.imported == 3 and summary.namespaces == {ns: 3}
    assert stored_texts(client, ns) == sorted(TEXTS[:3])


def test_a_plain_text_file_is_one_memory_per_line(client, ns, tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text(f"{TEXTS[0]}\n\n{TEXTS[1]}\r\n   \n{TEXTS[5]}\n", encoding="utf-8")
    report = validate_file(path, dim=DEFAULT_DIM)
    assert (report.rows, report.to_embed) == (3, 3)
    summary = import_file(client, path, default_namespace=ns, progress=None)
    assert summary.imported == 3 and summary.embedded == 3
    assert stored_texts(client, ns) == sorted([TEXTS[0], TEXTS[1], TEXTS[5]])
    [hit] = client.recall_text("Which editor does Dave use?", k=1, namespace=ns)
    assert hit.text == TEXTS[5]
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"fine\nalso fine\n\xff\xfe broken\n")
    with pytest.raises(ImportValidationError, match="line 3: not UTF-8"):
        validate_file(bad, dim=DEFAULT_DIM)


class NoEmbedder:
    """A client whose embedder must not be needed: touching it fails the test."""

    def __init__(self, client: Client) -> None:
        self.client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    @property
    def embedder(self) -> Any:
        raise AssertionError("the import loaded the embedder although no row left needs it")


def test_resuming_a_finished_import_does_not_load_the_model(client, ns, tmp_path):
    path = write_jsonl(tmp_path / "done.jsonl", [{"text": t, "namespace": ns} for t in TEXTS[:3]])
    assert import_file(client, path, progress=None).embedded == 3
    summary = import_file(NoEmbedder(client), path, resume=True, progress=None)
    assert (summary.imported, summary.skipped, summary.load_seconds) == (0, 3, 0.0)
    assert count(client, ns) == 3


# -- keys: an upsert, as kalos add does ---------------------------------------------------------


def test_a_key_column_upserts_by_key(client, ns, tmp_path, rng):
    vectors = unit(rng, 4)
    first = write_jsonl(tmp_path / "v1.jsonl", [
        {"text": "lives in Paris", "vector": vectors[0].tolist(), "key": "home", "namespace": ns},
        {"text": "prefers window seats", "vector": vectors[1].tolist(), "key": "seat", "namespace": ns},
        {"text": "no key: a plain add", "vector": vectors[2].tolist(), "namespace": ns},
    ])
    summary = import_file(client, first, batch=2, progress=None)
    assert summary.imported == 3 and count(client, ns) == 3
    home_id = client.get(keys=["home"], namespace=ns)[0].id
    second = write_jsonl(tmp_path / "v2.jsonl", [
        {"text": "moved to Berlin", "vector": vectors[3].tolist(), "key": "home", "namespace": ns},
    ])
    import_file(client, second, progress=None)
    home, seat = client.get(keys=["home", "seat"], namespace=ns)
    assert home.text == "moved to Berlin" and home.id == home_id and home.updated_at is not None
    assert seat.text == "prefers window seats"
    assert count(client, ns) == 3, "the key's row was added beside the old one"


def test_a_key_column_in_csv_with_a_custom_name(client, ns, tmp_path):
    path = tmp_path / "keyed.csv"
    path.write_text("id,text\nk1,The staging cluster runs in eu-west-1.\n,Backups are kept for thirty days.\n")
    import_file(client, path, columns=Columns(key="id"), default_namespace=ns, progress=None)
    [item] = client.get(keys=["k1"], namespace=ns)
    assert item is not None and item.text.startswith("The staging cluster") and item.key == "k1"
    assert count(client, ns) == 2


def test_bad_and_repeated_keys_are_listed_by_line_and_nothing_is_imported(client, ns, tmp_path, rng):
    vectors = unit(rng, 4)
    path = write_jsonl(tmp_path / "badkeys.jsonl", [
        {"text": "a", "vector": vectors[0].tolist(), "key": "a", "namespace": ns},
        {"text": "b", "vector": vectors[1].tolist(), "key": 7, "namespace": ns},
        {"text": "c", "vector": vectors[2].tolist(), "key": "", "namespace": ns},
        {"text": "d", "vector": vectors[3].tolist(), "key": "a", "namespace": ns},
        {"text": "e", "vector": vectors[3].tolist(), "key": "a", "namespace": ns + "-other"},  # another namespace: fine
    ])
    with pytest.raises(ImportValidationError) as caught:
        import_file(client, path, progress=None)
    where = [w for w, _ in caught.value.errors]
    assert where == ["line 2", "line 3", "line 4"], caught.value.errors
    assert "also on line 1" in caught.value.errors[2][1]
    assert count(client, ns) == 0 and count(client, ns + "-other") == 0


def test_an_interrupted_keyed_batch_is_added_again_on_resume(client, ns, tmp_path, rng):
    """A keyed batch left pending (killed between the commit and the progress write) cannot be
    told committed by the namespace's count (an upsert may not grow it): it is sent again."""
    vectors = unit(rng, 3)
    client.add(vectors[:1], keys=["k0"], namespace=ns, texts=["old"])
    path = write_jsonl(tmp_path / "pending.jsonl", [
        {"text": f"row {i}", "vector": vectors[i].tolist(), "key": f"k{i}", "namespace": ns} for i in range(3)
    ])
    import_file(client, path, progress=None)
    where = progress_path(path)
    document = json.loads(where.read_text())
    record = document["imports"][client.stats()["store"]]
    # As if killed after the add committed and before the progress said so.
    record["committed"], record["pending"] = 0, {"start": 0, "stop": 3, "namespace": ns, "count_before": 1,
                                                 "keyed": True}
    where.write_text(json.dumps(document))
    summary = import_file(client, path, resume=True, progress=None)
    assert summary.imported == 3 and count(client, ns) == 3
    assert [it.text for it in client.get(keys=["k0", "k1", "k2"], namespace=ns)] == ["row 0", "row 1", "row 2"]


def test_an_interrupted_import_says_how_far_it_got_and_how_to_resume(sidecar, client, ns, tmp_path, rng,
                                                                      monkeypatch, capsys):
    from kalos.tools import cli
    from kalos.tools.importer import ImportInterrupted

    vectors = unit(rng, 10)
    path = write_jsonl(tmp_path / "ten.jsonl", [
        {"text": f"row {i}", "vector": vectors[i].tolist(), "namespace": ns} for i in range(10)
    ])
    with pytest.raises(ImportInterrupted) as caught:
        import_file(Interrupting(client, at=3, when="before"), path, batch=3, progress=None)
    assert (caught.value.committed, caught.value.rows) == (6, 10)
    assert caught.value.progress_file == progress_path(path) and count(client, ns) == 6

    import kalos.tools.importer

    def interrupted(*args, **kwargs):
        raise ImportInterrupted(6, 10, progress_path(path))

    monkeypatch.setattr(kalos.tools.importer, "import_file", interrupted)
    assert cli.main(["import", str(path), "--name", sidecar.name, "--resume"]) == 130
    err = capsys.readouterr().err
    assert "interrupted after 6 of 10 rows" in err and "--resume" in err, err
