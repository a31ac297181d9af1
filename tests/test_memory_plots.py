"""`pagoda bench memory --plot`: the paper's figure 2 and the sharing savings as PNGs."""
import json

from PIL import Image

from pagoda.bench.memory import plot
from pagoda.cli import main
from tests.conftest import ROOT

COMMITTED = ROOT / "benchmarks" / "results" / "2026-11-22-cpu-bench-memory.json"
SIZE = (704, 484), (704, 396)  # figure inches x dpi: breakdown, sharing


def test_a_run_with_plot_draws_the_breakdown_beside_its_result(tmp_path, capsys):
    out = tmp_path / "memory.json"
    assert main(["bench", "memory", "--num-prompts", "12", "--num-blocks", "300", "--source", "trace",
                 "--sharing-prompts", "0", "--allocators", "paged,orca-oracle", "--output", str(out),
                 "--plot", str(tmp_path / "figures")]) == 0
    assert sorted(p.name for p in (tmp_path / "figures").iterdir()) == ["memory-breakdown.png"]  # no sharing run
    with Image.open(tmp_path / "figures" / "memory-breakdown.png") as image:
        assert (image.format, image.size) == ("PNG", SIZE[0])
    assert json.loads(out.read_text())["command"].endswith(f"--plot {tmp_path / 'figures'} --output {out}")


def test_from_result_draws_both_figures_of_a_result_written_before(tmp_path, capsys):
    assert main(["bench", "memory", "--from-result", str(COMMITTED), "--plot", str(tmp_path)]) == 0
    names = ["memory-breakdown.png", "sharing-savings.png"]
    assert capsys.readouterr().out.split() == [str(tmp_path / name) for name in names]
    for name, size in zip(names, SIZE):
        with Image.open(tmp_path / name) as image:
            assert (image.format, image.size) == ("PNG", size)
        assert (tmp_path / name).stat().st_size < 200_000


def test_the_readme_shows_both_figures_and_docs_holds_them_at_their_drawn_size(tmp_path):
    """docs/ holds the figures of the committed result (README's performance table), as `--from-result` draws them."""
    paths = plot(json.loads(COMMITTED.read_text()), tmp_path)
    readme = (ROOT / "README.md").read_text()
    for path in paths:
        committed = ROOT / "docs" / path.name
        assert f"(docs/{path.name})" in readme
        with Image.open(committed) as a, Image.open(path) as b:
            assert a.size == b.size
        assert committed.stat().st_size < 200_000
