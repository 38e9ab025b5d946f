"""The TruthfulQA behaviour page (experiments.truthfulqa_report.behaviour_page / main): written from the
result files of real tiny-model runs (verify and generate), every number read from them, a provenance
line per file, and the absence of probe cells said, not failed on."""
from __future__ import annotations

import json
from functools import partial

import pytest

from experiments.truthfulqa_report import behaviour_page, main
from toolkit.config import compose_config
from truthfulqa.run import run

tqa_config = partial(compose_config, "truthfulqa")
HEADER = "Type,Category,Question,Best Answer,Correct Answers,Incorrect Answers,Source\n"


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("tqa_page")
    csv = root / "small.csv"
    csv.write_text(HEADER + "".join(f"A,B,Is {i} odd?,{'Yes' if i % 2 else 'No'},{'Yes' if i % 2 else 'No'},"
                                    f"{'No' if i % 2 else 'Yes'},x\n" for i in range(3)))
    common = ["model=tiny", f"data_path={csv}", "n_boot=20", f"results_dir={root / 'results'}"]
    verify = json.loads(run(tqa_config(*common, "mode=verify", "format=plain")).read_text())
    generate = json.loads(run(tqa_config(*common, "mode=generate", "format=plain", "limit=2",
                                         "generate.max_new_tokens=4")).read_text())
    return root / "results", verify, generate


def test_behaviour_page_reads_every_number_from_the_files(results, tmp_path):
    results_dir, verify, generate = results
    page = behaviour_page(results_dir, "tiny")
    assert page.startswith(f"# TruthfulQA behaviour: what {verify['model_label']} says")
    assert "## verify-plain.json" in page and "## generate-plain-greedy-n4-limit2.json" in page
    assert page.count("Provenance: commit ") == 2 and "command `" in page and "machine " in page
    assert f"MC1 {verify['mc1_verify']:.3f} [{verify['mc1_verify_ci'][0]:.3f}, {verify['mc1_verify_ci'][1]:.3f}]" in page
    assert f"MC2_verify {verify['mc2_verify']:+.3f}" in page
    assert "No probe row: no true_vs_false / true_vs_all cells under" in page          # no cells: said
    a = generate["agreement"]
    assert f"accuracy {a['accuracy']:.3f}" in page and "Cohen's kappa" in page
    assert f"| truthful | {generate['pct_truthful']:.1f} [" in page
    assert "self-judging" in page                                                       # the judge is the model
    assert verify["prompt"]["template"] in page


def test_report_command_writes_the_page(results, tmp_path):
    results_dir, _, _ = results
    out = tmp_path / "page.md"
    main(["--results-dir", str(results_dir), "--model", "tiny", "--out", str(out)])
    assert out.read_text().startswith("# TruthfulQA behaviour")
    with pytest.raises(SystemExit, match="no TruthfulQA results under"):
        main(["--results-dir", str(tmp_path / "none"), "--model", "tiny", "--out", str(tmp_path / "x.md")])
    assert not (tmp_path / "x.md").exists()
