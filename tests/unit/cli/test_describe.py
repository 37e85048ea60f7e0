"""``python -m megatron_hybrid describe``: output, pipeline columns, PNG and exit code 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_hybrid.cli.main import main


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "megatron_hybrid", *args], capture_output=True, text=True
    )


def rows(text: str, header: str) -> list[list[str]]:
    """The rows of the table whose header line starts with ``header``, split on whitespace."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    table = []
    for line in lines[start + 1 :]:
        if not line.strip():
            break
        table.append(line.split())
    return table


def test_describe_prints_canonical_counts_and_layers(capsys):
    assert main(["describe", "[*-]{2}|[*E]{2}/*E", "--pp", "2"]) == 0
    out = capsys.readouterr().out
    assert "canonical  [*-][*-]|[*E][*E]/*E" in out
    assert "8 physical, 4 logical in 2 segment(s)" in out
    assert "* attention: 5, - dense MLP: 2, E MoE: 3" in out
    assert "1 depth(s) of '*E'" in out
    assert "final norm decoder.final_layernorm." in out
    layers = rows(out, "logical")
    # index, members, kind..., layer numbers, pp rank, vpp chunk, key prefix
    assert [(r[0], r[1], r[-4], r[-3], r[-2], r[-1]) for r in layers] == [
        ("0", "[*-]", "1-2", "0", "0", "decoder.layers.0."),
        ("1", "[*-]", "3-4", "0", "0", "decoder.layers.1."),
        ("2", "[*E]", "5-6", "1", "0", "decoder.layers.2."),
        ("3", "[*E]", "7-8", "1", "0", "decoder.layers.3."),
    ]
    mtp = rows(out, "MTP depth")
    # A GPT-layer MTP depth of a grouped pattern is saved under GPTModel's key (both members).
    assert [r[-1] for r in mtp] == ["mtp.layers.0.transformer_layer."] * 2
    assert {(r[-3], r[-2]) for r in mtp} == {("1", "0")}  # MTP sits on the last stage


def test_describe_vpp_from_pipes(capsys):
    assert main(["describe", "[*-]|[*-]|[*E]|[*E]/*E", "--pp", "2", "--vpp", "2"]) == 0
    out = capsys.readouterr().out
    assert "pp 2 x vpp 2 = 4 stage(s)" in out
    stages = rows(out, "stage")
    assert [(r[1], r[2], r[3], r[4], r[5]) for r in stages] == [
        ("0", "0", "2/1", "0/0", "[*-]"),
        ("1", "0", "2/1", "2/1", "[*-]"),
        ("0", "1", "2/1", "4/2", "[*E]"),
        ("1", "1", "2/1", "6/3", "[*E]"),
    ]
    assert [(r[-3], r[-2]) for r in rows(out, "logical")] == [
        ("0", "0"),
        ("1", "0"),
        ("0", "1"),
        ("1", "1"),
    ]


def test_describe_auto_split_and_ungrouped_keys(capsys):
    assert main(["describe", "(M-M*-){2}", "--pp", "2"]) == 0
    out = capsys.readouterr().out
    assert "canonical  M-M*-M-M*-" in out and "final norm decoder.final_norm." in out
    layers = rows(out, "logical")
    assert [r[-3] for r in layers] == ["0"] * 5 + ["1"] * 5
    assert [r[-1] for r in layers] == [f"decoder.layers.{i}." for i in range(10)]


@pytest.mark.parametrize(
    "pattern, stacked",
    [
        pytest.param("[*E]{3}", True, id="uniform-gpt-groups"),
        pytest.param("[*-][*E]{2}", False, id="mixed-groups"),
        pytest.param("[GE]{2}", False, id="non-gpt-groups"),
    ],
)
def test_describe_names_the_stacked_form(capsys, pattern, stacked):
    assert main(["describe", pattern]) == 0
    keys = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("keys"))
    assert ("stacked form" in keys) is stacked
    assert keys.startswith("keys       logical")


def test_describe_prints_stacked_keys_with_their_layer_index(capsys):
    assert main(["describe", "[*E]{3}"]) == 0
    layers = rows(capsys.readouterr().out, "logical")
    # The stacked form: one key prefix, the layer's index on the leading layer axis after it.
    assert [r[-2:] for r in layers] == [["decoder.layers.", f"[{i}/3]"] for i in range(3)]


def test_describe_first_stage_layers(capsys):
    assert main(["describe", "M{5}", "--pp", "2", "--first-stage-layers", "2"]) == 0
    stages = rows(capsys.readouterr().out, "stage")
    assert [r[3] for r in stages] == ["2/2", "3/3"]


def test_describe_empty_stage(capsys):
    assert main(["describe", "[*E]|", "--pp", "2"]) == 0
    assert rows(capsys.readouterr().out, "stage")[1][-1] == "(empty)"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["[*E]{3}X"], "invalid character 'X' at position 7"),
        (["[*E]{4}|[*E]{4}|[*E]{4}", "--pp", "2"], "--pp 2 must divide the 3"),
        (["[*E]{4}|[*E]{4}", "--vpp", "3"], "--vpp 3 disagrees"),
        (["[*E]{4}", "--vpp", "2"], "--vpp 2 needs '|'"),
        (["[*E]{3}", "--pp", "4"], "must divide the 6 physical layers"),
        (["[*E]{4}", "--pp", "3", "--first-stage-layers", "2"], "cuts logical layer 2"),
        (["[*E]|[*E]", "--pp", "2", "--first-stage-layers", "1"], "already define"),
    ],
    ids=[
        "bad-pattern",
        "pp-vs-segments",
        "vpp-mismatch",
        "vpp-without-pipes",
        "not-divisible",
        "cut-group",
        "first-with-pipes",
    ],
)
def test_describe_bad_input_exits_2(capsys, args, message):
    assert main(["describe", *args]) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.out == ""
    assert captured.err.startswith("python -m megatron_hybrid describe: error: ")


@pytest.mark.parametrize(
    "args",
    [["--pp", "0"], ["--pp", "two"], ["--first-stage-layers", "-1"], ["--unknown"]],
    ids=["pp-zero", "pp-word", "negative-first", "unknown-flag"],
)
def test_describe_bad_flags_exit_2(capsys, args):
    assert main(["describe", "[*E]", *args]) == 2
    assert "error:" in capsys.readouterr().err


def test_bad_pattern_subprocess_shows_caret_and_no_traceback():
    result = run_cli("describe", "[*E]{2}[E*]")
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.splitlines()
    assert "'E' (MoE) at position 8 must be the last layer of its group" in lines[0]
    assert lines[1] == "  pattern: '[*E]{2}[E*]'"
    assert lines[2].index("^") == len("  pattern: '") + 8
    assert "Traceback" not in result.stderr


def test_dash_pattern_needs_double_dash():
    result = run_cli("describe", "-*-*")
    assert result.returncode == 2 and "after '--': describe -- '-*-*'" in result.stderr
    result = run_cli("describe", "*-", "--pp", "-1")  # a bad number, not a pattern
    assert result.returncode == 2 and "must be >= 1" in result.stderr
    assert "hint" not in result.stderr
    result = run_cli("describe", "--", "-*-*")
    assert result.returncode == 0 and "canonical  -*-*" in result.stdout


def test_help_lists_describe_without_importing_torch():
    code = (
        "import sys\n"
        "from megatron_hybrid.cli.main import main\n"
        "assert main(['--help']) == 0\n"
        "assert main(['describe', '--help']) == 0\n"
        "heavy = {'torch', 'megatron', 'matplotlib'} & {m.split('.')[0] for m in sys.modules}\n"
        "assert not heavy, heavy\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "describe" in result.stdout and "--png FILE" in result.stdout


def test_png(tmp_path, capsys):
    path = tmp_path / "stack.png"
    assert main(["describe", "[*-]|[*E]|M[GE]|[*E]/*E", "--pp", "2", "--png", str(path)]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {path}" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("name", "written"),
    [
        pytest.param("stack", "stack.png", id="suffix-added"),
        pytest.param("stack.PNG", "stack.PNG", id="suffix-kept"),
        pytest.param("stack.v2", "stack.v2.png", id="other-suffix"),
    ],
)
def test_png_prints_the_file_it_wrote(tmp_path, capsys, name, written):
    assert main(["describe", "[*E]", "--png", str(tmp_path / name)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [written]
    assert f"wrote {tmp_path / written}" in capsys.readouterr().out


@pytest.mark.parametrize("name", ["", "dir/"], ids=["empty", "directory"])
def test_png_needs_a_file_name(tmp_path, capsys, monkeypatch, name):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "dir").mkdir()
    assert main(["describe", "[*E]", "--png", name]) == 2
    assert "--png needs a file name" in capsys.readouterr().err
    assert not (tmp_path / ".png").exists()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        pytest.param(["--pp", "4"], "--pp (4) must divide the 6 physical layers", id="pp"),
        pytest.param(
            ["--pp", "2", "--first-stage-layers", "5", "--last-stage-layers", "3"],
            "--first-stage-layers (5) and --last-stage-layers (3) do not fit",
            id="stage-layers",
        ),
    ],
)
def test_layout_errors_name_describe_options(capsys, argv, message):
    assert main(["describe", "[*E]{3}", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "_stage_layers" not in err and "pp_size" not in err


def test_png_unwritable_path(tmp_path, capsys):
    assert main(["describe", "[*E]", "--png", str(tmp_path / "missing" / "x.png")]) == 2
    assert "cannot write" in capsys.readouterr().err


def test_png_without_matplotlib(tmp_path, capsys, monkeypatch):
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.patches", "matplotlib.collections"):
        monkeypatch.setitem(sys.modules, name, None)  # makes `import` raise ImportError
    assert main(["describe", "[*E]", "--png", str(tmp_path / "x.png")]) == 2
    assert "pip install 'megatron_hybrid[viz]'" in capsys.readouterr().err


def test_console_entry_point_exists():
    from megatron_hybrid.__main__ import main as entry

    assert entry is main
