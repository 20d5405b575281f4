"""`make demo`: raw text to a trained, evaluated GPT on the embedded King James Bible, then the report.

Runs the eval flow (corpus -> pretrain -> evaluate) with its defaults; a second run reuses every cached stage.
"""

from __future__ import annotations

import json
import sys

from flows.eval import parse, run_eval
from flows.failures import command_line
from flows.server import prefect_api
from flows.summary import summarize, summary_table
from storage.artifacts import ArtifactStore


@command_line
def main(argv: list[str] | None = None) -> int:
    config = parse(argv)
    with prefect_api():
        refs = run_eval(config)
    store = config.pretrain.corpus.store
    print("\n" + summary_table(summarize({k: v for k, v in refs.items() if k != "pretrain"}, store)))
    evaluate = ArtifactStore(store).ref(refs["evaluate"])
    with open(evaluate.local_path("report.json")) as f:
        report = json.load(f)
    print("\nmetrics:")
    for name, value in report["metrics"].items():
        print(f"  {name}: {value:.4f}" if isinstance(value, float) else f"  {name}: {value}")
    print("\nsample generations:")
    for sample in report["generations"]:
        print(f"  {sample['prompt']!r} -> {sample['completion']!r}")
    print(f"\nreport: {evaluate.local_path('report.md')}")
    print(f"loss curves: {evaluate.local_path('loss_curves.png')}")
    print(f"trained run: {refs['pretrain']['url']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
