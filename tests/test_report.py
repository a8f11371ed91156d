"""The report's pieces on small fixtures, without a workflow run: how a figure is written, and the
"which build" section taken from the compare stage's summary as it is (the browser test renders a
whole page from a real run)."""
import pandas as pd

from moeshrink.report.load import Results
from moeshrink.report.render import Page
from moeshrink.report.text import below, decimal_size, html_table, p_text, points, rate_text, ratio_text


def test_figures_as_the_page_writes_them():
    assert (decimal_size(1.5e9), decimal_size(12.5e6)) == ("1.5 GB", "12.50 MB")
    assert (points(-0.04), points(1.26), points(-2.0), points(None)) == ("0.0", "+1.3", "-2.0", "-")
    assert (p_text(0.0123), p_text(0.00001), p_text(None)) == ("0.012", "1.0e-05", "-")
    assert (ratio_text(100, 100), ratio_text(25, 100), ratio_text(120, 100)) == (
        "reference", "75% smaller (4.00x)", "20% larger")
    assert rate_text({"value": 0.5, "ci95": [0.4, 0.6]}) == "50.0% [40.0, 60.0]" and rate_text(None) == "-"
    assert (below(0.01), below(-2.0), below(3.25)) == (
        "level with the original", "2.0 points above the original", "3.2 points below the original")


def test_a_table_escapes_every_cell_and_marks_per_build_tables():
    table = str(html_table(pd.DataFrame([{"Build": "<b>x</b>", "n": 1}])))
    assert "&lt;b&gt;x&lt;/b&gt;" in table and "<b>" not in table and "per-build" in table
    assert "per-build" not in str(html_table(pd.DataFrame([{"a": 1}]), per_build=False))


def page_with(summary: dict | None) -> Page:
    config = {"reference_build": "original", "compare": {"pass_mark_points": 2.0, "pass_on": "at_worst"},
              "builds": {"original": {"label": "Original"}, "a": {"label": "A"}, "b": {"label": "B"}}}
    return Page(Results(upstream={}, summary=summary), config)


def test_which_build_is_the_summarys_choice_and_nothing_else():
    summary = {"builds": {"a": {"verdicts": {"mmlu": {"verdict": "pass", "reason": "r"}}, "passes": True},
                          "b": {"verdicts": {"mmlu": {"verdict": "cannot tell", "reason": "r"}}, "passes": None}},
               "qualifying": ["a"], "failing": [], "undecided": ["b"], "fidelity": "a", "room": "a", "smallest": "a",
               "within_size": [{"size_gib": 1.0, "build": "a"}]}
    page = page_with(summary)
    assert page.which_build() == {"qualifying": ["a"], "failing": [], "undecided": ["b"], "fidelity": "a", "room": "a",
                                  "smallest": "a", "within_size": [{"size_gib": 1.0, "build": "a"}]}
    assert (page.passes("a"), page.passes("b"), page.verdicts("b")) == (True, None, ["cannot tell"])
    assert page_with(None).which_build() == {"qualifying": [], "failing": [], "undecided": [], "fidelity": None,
                                             "room": None, "smallest": None, "within_size": []}
    assert page.frontier() is None  # three builds: no frontier section


def test_the_agreement_table_says_where_the_kl_estimate_misses_its_exact_check():
    def check(relative: float) -> dict:
        return {"exact_check": {"positions": 1139, "relative_difference": relative, "tolerance": 0.05,
                                "within_tolerance": relative <= 0.05}}

    assert Page._exact_check(check(0.006)) == "0.6% on 1,139 positions"
    assert Page._exact_check(check(0.16)) == ("16.0% on 1,139 positions, over the 5% tolerance: this build's mean KL "
                                              "is well under its exact KL (raise evals.agreement.top_k)")
    assert Page._exact_check({}) == Page._exact_check({"exact_check": {"relative_difference": None}}) == "-"


def test_a_frontier_chart_draws_every_build_and_names_only_its_pareto_set():
    from moeshrink.report import charts

    points = [{"build": "original", "label": "Original", "x": 3.5, "y": 100.0, "low": None, "high": None,
               "kind": "reference", "group": "Original"},
              {"build": "twx3", "label": "<TWX3>", "x": 2.9, "y": 99.0, "low": 98.5, "high": 99.4,
               "kind": "quantize", "group": "twx3"},
              {"build": "cut", "label": "Cut", "x": 2.0, "y": 98.0, "low": 97.0, "high": 98.9,
               "kind": "prune", "group": "router_sum"},
              {"build": "worse", "label": "Worse", "x": 3.0, "y": 90.0, "low": 89.0, "high": 91.0,
               "kind": "prune+quantize", "group": "reap + twx3"}]
    svg = str(charts.frontier(points, ["original", "twx3", "cut"], "weights (MB)", "agreement (%)", "t", "{:.1f}",
                              (0.0, 100.0), mark_line=(95.0, "a line")))
    assert [svg.count(f'data-build="{b}"') for b in ("original", "twx3", "cut", "worse")] == [1, 1, 1, 1]
    assert svg.count('class="pareto-name"') == 3 and ">Worse</text>" not in svg and "<title>Worse</title>" in svg
    assert svg.count('class="pareto-number"') == 3
    assert "&lt;TWX3&gt;" in svg and "<TWX3>" not in svg
    assert svg.count('class="pareto"') == 1 and "<polygon" in svg and "<rect" in svg and "a line" in svg
