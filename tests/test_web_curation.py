"""Web curation: WARC/WET input, URL filter, extraction, language ID, decontamination, FineWeb rules, PII.

The tests write their own crawl (tests/helpers/web_pages.py): HTML pages in four languages with boilerplate, pages on
blocklisted hosts, evaluation passages planted in some, an image, an empty page and a record damaged on disk;
every page's fate is known, so each step's drops are checked exactly.
"""

from __future__ import annotations

import dataclasses
import glob
import gzip
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from stages import clean, download
from stages.clean import CleanParams
from stages.decontaminate import NgramIndex, evaluation_texts, split_around, word_spans
from stages.pii import replace_pii
from stages.shards import process_pool
from stages.url_filter import read_blocklists
from storage.artifacts import ArtifactStore
from storage.warc import iter_warc_pages, new_warc_stats
from tests.helpers.web_pages import Page, html_page, kjv_chapters, random_passages, write_crawl, write_warc

ROOT = Path(__file__).resolve().parents[1]
SERIAL = process_pool(1)


@pytest.fixture(scope="module")
def crawl(tmp_path_factory):
    return write_crawl(str(tmp_path_factory.mktemp("web")))


@pytest.fixture(scope="module")
def raw(crawl, tmp_path_factory):
    """The crawl folder (its WARC and WET file) downloaded, six pages a shard."""
    store = ArtifactStore(str(tmp_path_factory.mktemp("raw")))
    return download.run(download.DownloadParams(source=crawl.folder, docs_per_shard=6), [], store)


def every_step(crawl, **overrides) -> CleanParams:
    values = {
        "url_blocklist": (crawl.domains,),
        "url_banned_words": ("casino",),
        "languages": ("en",),
        "decontaminate": (crawl.lambada, crawl.wikitext),
        "fineweb": True,
        "pii": True,
    }
    return CleanParams(**{**values, **overrides})


def documents(ref) -> list[dict]:
    return [doc for name in ref.files("shards/") for doc in pq.read_table(ref.local_path(name)).to_pylist()]


def test_download_reads_warc_and_wet_pages_and_counts_what_it_drops(crawl, raw):
    counts = raw.manifest()["counts"]
    fates = list(crawl.fate.values())
    assert counts["dropped"] == {
        reason: fates.count(reason) for reason in ("non_html", "empty_page", "unparsable_record")
    }
    assert counts["bad_record_offsets"] == crawl.bad_offsets
    assert counts["warc_records"] == crawl.records - 1  # all but the damaged one
    docs = documents(raw)
    assert counts["docs"] == len(docs) == len(crawl.fate) - 3
    assert {d["url"] for d in docs} == {
        u for u, f in crawl.fate.items() if f not in ("non_html", "empty_page", "unparsable_record")
    }
    page = next(d for d in docs if d["url"] == "http://news.example/article-0")
    assert page["content_type"] == "text/html" and page["date"] == "2024-05-01T12:00:00Z"
    assert page["text"].startswith("<!DOCTYPE html>") and len(page["id"]) == 36  # the WARC-Record-ID's UUID
    wet = next(d for d in docs if d["url"] == "http://wet.example/en")
    assert wet["content_type"] == "text/plain" and not wet["text"].startswith("<")


def test_each_step_drops_exactly_the_pages_planted_for_it(crawl, raw, tmp_path):
    ref = clean.run(every_step(crawl), [raw], ArtifactStore(str(tmp_path)), map_shards=SERIAL)
    counts = ref.manifest()["counts"]
    expected = {}
    for fate in crawl.fate.values():
        if fate not in ("kept", "non_html", "empty_page", "unparsable_record"):
            expected[fate] = expected.get(fate, 0) + 1
    assert {k: v for k, v in counts["dropped"].items() if v} == expected
    docs = documents(ref)
    assert sorted(d["url"] for d in docs) == sorted(u for u, f in crawl.fate.items() if f == "kept")
    steps = counts["steps"]
    assert list(steps) == sorted(
        ["url_filter", "extract", "repair", "language", "decontaminate", "quality", "pii"]
    )
    assert steps["url_filter"]["dropped"] == {"url_domain": 3, "url_listed": 1, "url_banned_word": 1}
    assert steps["extract"] == {
        "docs_in": 21,
        "docs_out": 20,
        "dropped": {"extracted_empty": 1},
    }  # 2 WET: no HTML
    assert steps["language"] == {"docs_in": 22, "docs_out": 17, "dropped": {"language": 5}}
    assert counts["languages"] == {"en": 17, "de": 3, "fr": 1, "es": 1}
    assert steps["decontaminate"]["dropped"] == {"contaminated_lambada_test": 2, "contaminated_wiki": 1}
    assert steps["quality"]["dropped"] == {"c4_lorem_ipsum": 1, "fineweb_short_lines": 1}
    for name, step in steps.items():  # documents flow from one step to the next
        assert step["docs_out"] == step["docs_in"] - sum(step["dropped"].values()), name
    assert steps["pii"]["docs_out"] == counts["docs_out"] == len(docs) == 12
    # Boilerplate is gone, language and score are stored, PII is replaced (private addresses stay).
    assert not any(
        "cookies" in d["text"] or "Related post" in d["text"] or "Copyright" in d["text"] for d in docs
    )
    assert all(d["language"] == "en" and 0.65 < d["language_score"] <= 1 for d in docs)
    contact = next(d["text"] for d in docs if d["url"].endswith("/contact"))
    assert (
        "Write to email@example.com or firstname.lastname@example.org, servers 22.214.171.124 and 192.168.1.20."
        in contact
    )
    assert counts["pii"] == {"emails": 2, "ips": 1}
    assert sorted(ref.files("filters/")) == [
        "filters/decontamination.json",
        "filters/decontamination_files.npy",
        "filters/decontamination_keys.npy",
        "filters/url_blocklist.json",
    ]


def test_split_mode_keeps_the_text_around_a_match_and_trafilatura_drops_the_same(crawl, raw, tmp_path):
    split = clean.run(
        every_step(crawl, decontaminate_mode="split"),
        [raw],
        ArtifactStore(str(tmp_path / "s")),
        map_shards=SERIAL,
    )
    counts = split.manifest()["counts"]
    assert not any(reason.startswith("contaminated") and n for reason, n in counts["dropped"].items())
    assert counts["decontaminate_split"] == {"contaminated_lambada_test": 2, "contaminated_wiki": 1}
    pieces = [d for d in documents(split) if "#" in d["id"]]
    # The whole passage sits between verses (two pieces), the 13-gram too, the WikiText paragraph ends its page.
    assert sorted(d["url"].rsplit("/", 1)[1] for d in pieces) == sorted(
        ["lambada-whole"] * 2 + ["lambada-13"] * 2 + ["wiki-copy"]
    )
    lambada = [json.loads(line)["text"] for line in Path(crawl.lambada).read_text().splitlines()]
    index = NgramIndex.build([crawl.lambada, crawl.wikitext], 13)
    assert all(index.match(word_spans(d["text"])[0]) is None for d in pieces)
    assert not any(lambada[0][:80] in d["text"] for d in pieces)

    other = clean.run(
        every_step(crawl, extractor="trafilatura"),
        [raw],
        ArtifactStore(str(tmp_path / "t")),
        map_shards=SERIAL,
    )
    resiliparse = clean.run(every_step(crawl), [raw], ArtifactStore(str(tmp_path / "r")), map_shards=SERIAL)
    assert other.manifest()["counts"]["dropped"] == resiliparse.manifest()["counts"]["dropped"]
    assert not any("Related post" in d["text"] for d in documents(other))


def test_warc_reader_resumes_after_damage_in_plain_and_gzip_files(tmp_path):
    pages = [
        Page(f"http://a.example/{i}", html_page(f"P{i}", [f"Paragraph {i}."], "a.example").encode())
        for i in range(4)
    ]
    pages.append(
        Page(
            "http://a.example/latin",
            "<p>caf\u00e9 cr\u00e8me</p>".encode("latin-1"),
            "text/html; charset=iso-8859-1",
        )
    )
    pages.append(Page("http://a.example/bogus", pages[-1].body, "text/html; charset=foo"))
    plain = str(tmp_path / "plain.warc")
    offsets = write_warc(plain, pages, gzip=False)
    data = bytearray(Path(plain).read_bytes())
    data[offsets[1] : offsets[1] + 8] = b"GARBAGE!"  # the second page's WARC/1.0 line
    Path(plain).write_bytes(bytes(data))
    stats = new_warc_stats()
    got = list(iter_warc_pages(plain, stats))
    assert [page["url"] for _, page in got] == [p.url for p in pages if p.url != "http://a.example/1"]
    assert [offset for offset, _ in got] == [o for i, o in enumerate(offsets) if i != 1]
    assert stats["bad_offsets"] == {plain: [offsets[1]]} and stats["dropped"]["unparsable_record"] == 1
    assert got[-2][1]["text"] == got[-1][1]["text"] == "<p>caf\u00e9 cr\u00e8me</p>"  # a charset no codec has

    cut = str(tmp_path / "cut.warc.gz")
    offsets = write_warc(cut, pages)
    Path(cut).write_bytes(Path(cut).read_bytes()[: offsets[3] + 100])  # a download cut short in page 3
    stats = new_warc_stats()
    assert [page["url"] for _, page in iter_warc_pages(cut, stats)] == [p.url for p in pages[:3]]
    assert stats["bad_offsets"] == {cut: [offsets[3]]}

    junk = tmp_path / "junk.warc.gz"
    junk.write_bytes(gzip.compress(b"this is no WARC file\r\n" * 10))
    stats = new_warc_stats()
    assert list(iter_warc_pages(str(junk), stats)) == [] and stats["bad_offsets"] == {str(junk): [0]}


def test_url_blocklist_matches_hosts_label_by_label(tmp_path):
    listed = tmp_path / "domains.txt"
    listed.write_text(
        "# comment\nexample.com\n*.corp.internal\nlocalhost\n10.1.2.3\nhttps://ok.example/blocked?id=1\n"
    )
    blocklist = read_blocklists([str(listed)], ["casino"], "--clean.url-blocklist")
    reasons = {
        url: blocklist.reason(url)
        for url in (
            "http://example.com/", "https://WWW.Example.COM:443/a", "http://a.b.example.com./x",
            "http://badexample.com/", "http://example.com.evil.net/", "http://git.corp.internal/x",
            "http://corp.internal/", "http://internal/", "http://localhost:8000/", "http://10.1.2.3/admin",
            "https://ok.example/blocked?id=1", "https://ok.example/blocked?id=2", "http://ok.example/Casino-Night",
            "http://ok.example/casinos", "not a url",
        )
    }  # fmt: skip
    assert reasons == {
        "http://example.com/": "url_domain",
        "https://WWW.Example.COM:443/a": "url_domain",
        "http://a.b.example.com./x": "url_domain",
        "http://badexample.com/": None,
        "http://example.com.evil.net/": None,
        "http://git.corp.internal/x": "url_domain",
        "http://corp.internal/": "url_domain",
        "http://internal/": None,
        "http://localhost:8000/": "url_domain",
        "http://10.1.2.3/admin": "url_domain",
        "https://ok.example/blocked?id=1": "url_listed",
        "https://ok.example/blocked?id=2": None,
        "http://ok.example/Casino-Night": "url_banned_word",
        "http://ok.example/casinos": None,
        "not a url": None,
    }
    listed.write_text("example.com\nnot a domain\n")
    with pytest.raises(
        ValueError, match=r"--clean.url-blocklist: .*domains.txt:2: 'not a domain' is neither"
    ):
        read_blocklists([str(listed)], [], "--clean.url-blocklist")


def test_decontamination_finds_every_planted_passage_in_every_format_and_nothing_else(tmp_path):
    passages = random_passages(40, 50, seed=7)
    (tmp_path / "lambada_test.jsonl").write_text(
        "".join(json.dumps({"text": p}) + "\n" for p in passages[:10])
    )
    (tmp_path / "wiki.test.tokens").write_text(
        "".join(f" = = Section = = \n {p.replace(' ', ' @-@ ', 2)[:-1]} . \n" for p in passages[10:20])
    )
    rows = [f"{i}\tx\t{passages[20 + i]}\t{passages[25 + i]}\tneutral" for i in range(5)]
    (tmp_path / "dev_matched.tsv").write_text(
        "index\tgenre\tsentence1\tsentence2\tgold_label\n" + "\n".join(rows) + "\n"
    )
    race = tmp_path / "RACE" / "test" / "high"
    race.mkdir(parents=True)
    for i in range(5):
        record = {
            "article": passages[30 + i],
            "questions": ["Why?"],
            "options": [[passages[35 + i], "b", "c", "d"]],
            "answers": ["A"],
            "id": f"{i}.txt",
        }
        (race / f"{i}.txt").write_text(json.dumps({**record, "options": record["options"]}))
    files = [str(tmp_path / n) for n in ("lambada_test.jsonl", "wiki.test.tokens", "dev_matched.tsv")] + [
        str(race)
    ]
    assert sum(1 for f in files for _ in evaluation_texts(f)) == 10 + 1 + 10 + 5 * (2 + 4)
    index = NgramIndex.build(files, 13)
    rng = random.Random(3)
    chapters = kjv_chapters()
    owner = [0] * 10 + [1] * 10 + [2] * 10 + [3] * 10
    for number, passage in enumerate(passages):
        words = passage.split()
        start = rng.randrange(len(words) - 13)
        chapter = chapters[number].split(" ")
        cut = rng.randrange(len(chapter))
        text = " ".join(
            chapter[:cut] + [" ".join(words[start : start + rng.randint(13, 30)]).upper()] + chapter[cut:]
        )
        found = index.match(word_spans(text)[0])
        assert found is not None and found[0] == owner[number], number  # recall 1.0, counted under its file
    assert not any(index.match(word_spans(chapter)[0]) for chapter in chapters[:400])  # no false hits
    spans = word_spans(passages[0])[1]
    twelve = passages[0][: spans[11][1]]  # 12 words (\w+ runs: "children's" is two)
    assert index.match(word_spans(f"{chapters[0]} {twelve} {chapters[1]}")[0]) is None
    # Split mode: what remains is the text before and after the match, each piece long enough to keep.
    text = f"{chapters[0]} {passages[0]} {chapters[1]}"
    hashes, spans = word_spans(text)
    pieces = split_around(text, spans, index.match(hashes)[1], 13)
    assert pieces == [chapters[0].strip(), chapters[1].strip()]


def test_pii_is_replaced_as_datatrove_replaces_it():
    formatters = pytest.importorskip("datatrove.pipeline.formatters")
    text = (
        "Mail anna@example.net, bob.smith+news@mail.co.uk or carol@[192.168.0.1]; hosts 8.8.8.8, 1.1.1.1, 10.0.0.1, "
        "127.0.0.1, 203.0.113.9 and 999.1.1.1. Version 1.2.3.4 too."
    )
    ours, emails, ips = replace_pii(text)
    assert ours == formatters.PIIFormatter().format(
        text
    )  # a fresh formatter starts its turn as each document does
    assert (emails, ips) == (3, 4) and "10.0.0.1" in ours and "127.0.0.1" in ours


def test_bad_inputs_end_in_errors_naming_the_flag_and_file(crawl, raw, tmp_path, capsys):
    from flows.cli import parse_config
    from flows.corpus_plan import CorpusConfig

    store = ArtifactStore(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="--clean.decontaminate: .*nope.jsonl: no such"):
        clean.run(
            every_step(crawl, decontaminate=(str(tmp_path / "nope.jsonl"),)), [raw], store, map_shards=SERIAL
        )
    with pytest.raises(FileNotFoundError, match="--clean.url-blocklist: .*nope.txt: no such file"):
        clean.run(CleanParams(url_blocklist=(str(tmp_path / "nope.txt"),)), [raw], store, map_shards=SERIAL)
    jsonl = tmp_path / "plain.jsonl"
    jsonl.write_text(json.dumps({"text": kjv_chapters()[0]}) + "\n")
    plain = download.run(download.DownloadParams(source=str(jsonl)), [], store)
    with pytest.raises(ValueError, match=r"plain.jsonl:1' has no url; --clean.url-blocklist"):
        clean.run(CleanParams(url_banned_words=("casino",)), [plain], store, map_shards=SERIAL)
    for flags, message in (
        (["--clean.languages", "english"], "languages: 'english' is not a language code of lid.176"),
        (["--clean.extractor", "lynx"], "extractor is 'lynx'; choose one of resiliparse, trafilatura"),
        (["--clean.decontaminate-mode", "mask"], "decontaminate_mode is 'mask'; choose drop or split"),
    ):
        with pytest.raises(SystemExit):
            parse_config(CorpusConfig, flags, "test")
        assert f"error: --clean: {message}" in capsys.readouterr().err
    config = parse_config(
        CorpusConfig, ["--clean.languages", "en,de", "--clean.url-blocklist", "a.txt", "b.txt"], "t"
    )
    assert config.clean.languages == ("en", "de") and config.clean.url_blocklist == ("a.txt", "b.txt")


def _committed(store: Path) -> list[str]:
    return [
        m
        for m in glob.glob(str(store / "clean" / "*" / "_shards" / "*.json"))
        if not m.endswith("filters.json")
    ]


@pytest.mark.processes
def test_sigkill_mid_extraction_then_rerun_is_byte_identical(crawl, tmp_path):
    """The clean stage of one page a shard, killed after its first shard; the rerun skips what was committed and
    writes what an uninterrupted run writes."""
    source = download.run(
        download.DownloadParams(source=crawl.folder, docs_per_shard=1),
        [],
        ArtifactStore(str(tmp_path / "raw")),
    )
    params = every_step(crawl, extractor="trafilatura")
    code = (
        "import sys; from stages import clean; from stages.shards import process_pool; "
        "from storage.artifacts import ArtifactStore; "
        f"source = ArtifactStore({str(tmp_path / 'raw')!r}).find('download', {source.key!r}); "
        f"clean.run(clean.CleanParams(**{dataclasses.asdict(params)!r}), [source], ArtifactStore(sys.argv[1]), "
        "map_shards=process_pool(1))"
    )
    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(killed)],
        cwd=ROOT,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and not _committed(killed):
        time.sleep(0.01)
    assert proc.poll() is None, "the clean stage finished before it could be killed"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done = len(_committed(killed))
    assert 0 < done < len(source.files("shards/")) and not glob.glob(
        str(killed / "clean" / "*" / "manifest.json")
    )

    resumed = clean.run(params, [source], ArtifactStore(str(killed)), map_shards=SERIAL)
    fresh = clean.run(params, [source], ArtifactStore(str(tmp_path / "fresh")), map_shards=SERIAL)
    assert resumed.key == fresh.key
    assert file_hashes(resumed) == file_hashes(fresh)


def file_hashes(ref) -> dict:
    """The artifact's files by size and hash, a shard's counts without the seconds it took."""
    files = dict(ref.manifest()["files"])
    for name in [n for n in files if n.startswith("stats/")]:
        files[name] = {
            k: v for k, v in json.loads(Path(ref.local_path(name)).read_text()).items() if k != "seconds"
        }
    return files


@pytest.mark.processes
def test_the_issue_command_runs_warc_to_megatron_token_files(prefect_api_url, crawl, tmp_path):
    """`python -m flows.corpus --download.source 'crawl/*.warc.gz' --clean.url-blocklist domains.txt
    --clean.languages en --clean.decontaminate lambada_test.jsonl`, word for word, in the crawl's folder."""
    root = Path(crawl.folder).parent
    command = [
        sys.executable, "-m", "flows.corpus", "--download.source", "crawl/*.warc.gz",
        "--clean.url-blocklist", "domains.txt", "--clean.languages", "en", "--clean.decontaminate", "lambada_test.jsonl",
    ]  # fmt: skip
    env = {**os.environ, "PREFECT_API_URL": prefect_api_url, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    table = {
        line.split("|")[0].strip(): [cell.strip() for cell in line.split("|")]
        for line in done.stdout.splitlines()
        if "|" in line
    }
    assert "url_domain=3" in table["clean"][6] and "url_listed=1" in table["clean"][6]
    assert "contaminated_lambada_test=2" in table["clean"][6]
    assert table["clean/url_filter"][2:4] == [
        "26",
        "22",
    ]  # the WARC's 26 pages in, the 4 on blocked hosts out
    assert table["clean/decontaminate"][6] == "contaminated_lambada_test=2"
    assert "documents per language (clean/language): de=2, en=17, es=1, fr=1" in done.stdout
    assert "non_html=1" in table["download"][6] and "unparsable_record=1" in table["download"][6]
    tokens = done.stdout.split("tokens: ")[-1].strip()
    assert {"manifest.json", "tokens_text_document.bin", "tokens_text_document.idx"} <= set(
        os.listdir(tokens)
    )
    from storage.indexed_dataset import IndexedDataset

    assert len(IndexedDataset(f"{tokens}/tokens_text_document").document_indices) - 1 == int(
        table["dedup"][3]
    )
