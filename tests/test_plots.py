"""Every plot draws a method in the same colour, counts layers in whole numbers, marks 1x on
speedup panels, keeps a one-cell heatmap's title readable, and does not call the demo data LongBench."""
import matplotlib
import pytest
from matplotlib.colors import to_hex
from matplotlib.figure import Figure

from longpatch.plotting import METHOD_COLORS, method_color

matplotlib.use("Agg")


@pytest.fixture
def figures(monkeypatch):
    """Every figure saved while the test runs."""
    saved = []
    original = Figure.savefig

    def savefig(self, *args, **kwargs):
        saved.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return saved


def check_axes(fig):
    """The conventions every panel keeps; returns {method label: colour} of its lines."""
    colours = {}
    for ax in fig.axes:
        if "replaced" in ax.get_xlabel():  # a layer-count axis: whole numbers only
            ax.figure.canvas.draw()
            ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
            assert ticks and all(float(t).is_integer() for t in ticks), (ax.get_title(), ticks)
        if "speedup" in ax.get_ylabel():
            assert any(list(line.get_ydata()) == [1, 1] for line in ax.get_lines()), ax.get_title()
        for line in ax.get_lines():
            label = line.get_label()
            if label in METHOD_COLORS:
                assert to_hex(line.get_color()) == to_hex(method_color(label)), (ax.get_title(), label)
                colours.setdefault(label, set()).add(to_hex(line.get_color()))
    return colours


def test_method_colours_are_fixed_and_stable():
    assert len(set(METHOD_COLORS.values())) == len(METHOD_COLORS)
    assert method_color(None) == method_color("exact")
    assert method_color("probe") == method_color("probe") and method_color("probe") not in METHOD_COLORS.values()


def test_bench_panels_keep_each_methods_colour(tmp_path, figures):
    from longpatch.bench import attention as bench
    from longpatch.bench import decode as bench_decode

    # moba is causal only: without one colour map the non-causal panel shifted sparse and performer's colours
    rows = [{"method": m, "causal": c, "n": n, "speedup_fwd": 1.5}
            for m in ("hyper", "moba", "sparse", "performer") for c in (True, False) for n in (256, 512)
            if c or m != "moba"]
    bench.plot(rows, tmp_path / "a.png")
    bench_decode.plot([{"method": m, "cache_len": n, "exact_ms": 1.0, "decode_ms": 0.5, "speedup": 2.0}
                       for m in ("moba", "sparse") for n in (256, 512)], tmp_path / "d.png")
    assert len(figures) == 2
    for fig in figures:
        check_axes(fig)
    panels = [check_axes(type("F", (), {"axes": [ax]})) for ax in figures[0].axes]
    assert sorted(map(sorted, panels)) == [["hyper", "moba", "performer", "sparse"], ["hyper", "performer", "sparse"]]


def test_demo_figure_keeps_colours_integer_layers_and_the_1x_line(tmp_path, figures):
    from longpatch.eval.demo import _plot_demo

    rows = [{"config": cfg, "method": method if n else "exact", "layers": n, "ppl": 30.0 + n,
             "attention_speedup": 1.0 + n / 4, "needle_accuracy": 1.0}
            for cfg, method in (("demo", "hyper"), ("demo-moba", "moba")) for n in (0, 1, 2)]
    _plot_demo(rows, tmp_path / "f.png", {"template": "passkey", "length": 256})
    colours = check_axes(figures[0])
    assert colours.keys() == {"hyper", "moba"} and all(len(c) == 1 for c in colours.values())


def test_needle_heatmap_of_one_cell_keeps_its_title(tmp_path, figures):
    from longpatch.eval.needle import prompts as N

    records = [{"config": "demo-moba", "layers": 4, "length": 256, "depth": 0.5, "correct": True}]
    title = "/a/rather/long/path/to/the/shipped/demo_model: demo-moba, 4 layers replaced (passkey)"
    N.heatmap(records, "demo-moba", 4, tmp_path / "h.png", title=title)
    fig = figures[0]
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(fig).get_renderer()  # pyplot closed the figure after saving it
    ax = fig.axes[0]
    box = ax.title.get_window_extent(renderer)
    assert ax.title.get_fontsize() >= 8
    assert box.x0 >= 0 and box.x1 <= fig.bbox.x1 and box.y1 <= fig.bbox.y1, (box, fig.bbox)
    assert ax.title.get_text().replace("\n", " ") == title


@pytest.fixture(scope="module")
def demo_data_runs(tmp_path_factory):
    """eval ppl and eval longbench on --data demo (a tiny model, the byte tokenizer), their plots kept."""
    from longpatch.eval.longbench.run import longbench
    from longpatch.eval.ppl.run import perplexity

    out = tmp_path_factory.mktemp("plots")
    perplexity("tiny:llama", "0,1", method="moba", data="demo", seq_len=64, max_docs=2, tokenizer="bytes",
               warmup=0, progress=False, out=str(out / "ppl"))
    longbench("tiny:llama", "0,1", method="sparse", data="demo", max_samples=1, max_length=256, max_new_tokens=2,
              tokenizer="bytes", progress=False, out=str(out / "lb"))
    return out


def test_eval_plots_use_the_methods_colour_and_do_not_call_demo_data_longbench(demo_data_runs, figures):
    from longpatch.eval.longbench import run as longbench_run
    from longpatch.eval.ppl import report

    report.summarize(demo_data_runs / "ppl")
    longbench_run.summarize(demo_data_runs / "lb")
    assert len(figures) == 4  # ppl, speedup, ppl by category; scores
    for fig in figures:
        check_axes(fig)
        titles = [ax.get_title() for ax in fig.axes] + [fig._suptitle.get_text() if fig._suptitle else ""]
        assert not any("LongBench" in t for t in titles), titles
        assert not any("LongBench" in ax.get_ylabel() for ax in fig.axes)
    ppl, speed, _, scores = figures
    for fig, method in ((ppl, "moba"), (speed, "moba"), (scores, "sparse")):
        lines = [ln for ln in fig.axes[0].get_lines() if list(ln.get_ydata()) != [1, 1]]
        assert lines and {to_hex(ln.get_color()) for ln in lines} == {to_hex(method_color(method))}
