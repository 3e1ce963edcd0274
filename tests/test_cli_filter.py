"""`fastgrad --filter-eps`: gradient filtering in the main job (memory-saving mode only)."""

import json

from cli_helpers import fastgrad_inprocess

_run = fastgrad_inprocess


def test_filter_eps_reports_the_skipped_fraction():
    p = _run("--bt", "300", "--hidden", "16", "--vocab", "20000", "--filter-eps", "1", "--json",
             "--threads", "2", "--samples", "2")
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    f = r["filter"]
    assert f["filter_eps"] == 1.0 and f["blocks_total"] > 0
    assert 0 < f["blocks_skipped"] < f["blocks_total"]          # every block but the targets'
    assert f["fraction_skipped"] == f["blocks_skipped"] / f["blocks_total"]
    p = _run("--bt", "40", "--hidden", "16", "--vocab", "700", "--filter-eps", "auto", "--shards", "2",
             "--samples", "2", "--no-progress")
    assert p.returncode == 0, p.stderr
    assert "gradient filtering: filter_eps 0.000244" in p.stdout and "blocks skipped (" in p.stdout
    r = json.loads(_run("--bt", "40", "--hidden", "16", "--vocab", "700", "--json", "--samples", "0").stdout)
    assert "filter" not in r


def test_filter_eps_refusals():
    for args, words in ((["--mode", "high-performance", "--filter-eps", "auto"], "--mode memory-saving"),
                        (["--filter-eps", "0"], "auto or a number in (0, 1]"),
                        (["--filter-eps", "fast"], "auto or a number in (0, 1]")):
        p = _run("--bt", "8", "--hidden", "8", "--vocab", "200", *args)
        assert p.returncode == 2, (args, p.stderr)
        err = p.stderr.strip()
        assert "\n" not in err and "--filter-eps" in err and words in err, err
        assert "Traceback" not in p.stderr
