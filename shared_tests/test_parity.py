"""Every case of the shared table, every path, every pair within tolerance; and the harness
catches a broken layer (a parity check that cannot fail would be worthless)."""

import json
import re

import numpy as np
import pytest

import PyTorch.Multi_Head_Attention as torch_file
import TensorFlow.Multi_Head_Attention as tf_file
from PyTorch import MultiHeadAttention as TorchMultiHeadAttention
from shared_tests import parity, runtimes
from shared_tests.calling import not_implemented
from shared_tests.cases import (
    CASES,
    CASES_BY_NAME,
    INDEX_CASES,
    INDEX_MARGIN,
    MLA_CASES,
    TOLERANCES,
    index_margin,
    index_rankings,
    make_data,
)
from shared_tests.runtimes import DYNAMIC_PATHS, RUNTIME_PATHS, skip_reason
from TensorFlow import MultiHeadAttention as TFMultiHeadAttention


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_case_in_parity(case):
    row, results = parity.run_case(case)
    assert row.passed, row.failures
    assert row.zeros
    assert set(results) | set(row.skipped) == set(parity.PATHS)
    assert set(row.skipped) == {path for path in RUNTIME_PATHS if skip_reason(case, path)}
    assert all(np.isfinite(r.output).all() for r in results.values())


@pytest.mark.parametrize("case", MLA_CASES, ids=lambda c: c.name)
def test_mla_case_in_parity(case):
    """Multi-head latent attention on every path whose layer file has it; the others are listed as
    not implemented, never failed or dropped."""
    row, results = parity.run_case(case)
    assert row.passed, row.failures
    assert row.zeros
    assert set(results) | set(row.skipped) == set(parity.PATHS)
    expected = {path for path in parity.PATHS if not_implemented(case, path) or skip_reason(case, path)}
    assert set(row.skipped) == expected
    assert all(reason.startswith("not implemented in") for path, reason in row.skipped.items() if path.startswith("tf"))
    assert {"numpy", "torch:sdpa", "torch:explicit", "torch:inference", "torch:onnx"} <= set(results)


@pytest.mark.parametrize(
    ("case", "paths"),
    [
        (case, tuple(p for p in parity.PATHS if p not in RUNTIME_PATHS) + ("torch:onnx",) * (case.absorb is True))
        for case in INDEX_CASES
    ],
    ids=[case.name for case in INDEX_CASES],
)
def test_index_case_in_parity(case, paths):
    """The sparse indexer on the frameworks' paths, the absorbed case also through the PyTorch ONNX
    export (ONNX's TopK); the report adds the Keras backends, tf:onnx and LiteRT."""
    row, results = parity.run_case(case, paths=paths)
    assert row.passed, row.failures
    assert row.zeros
    assert set(results) == set(paths)


def test_index_cases_keep_the_margin():
    """Each row's k-th and (k+1)-th allowed scores lie INDEX_MARGIN apart in the drawn data, and the
    case's first seed (0) would not have kept it: the seed was advanced."""
    from shared_tests import numpy_runner
    from shared_tests.cases import draw_data

    for case in INDEX_CASES:
        rankings = index_rankings(case, make_data(case), numpy_runner.run)
        assert rankings and min(index_margin(*ranking) for ranking in rankings) >= INDEX_MARGIN
    assert any(
        index_margin(*ranking) < INDEX_MARGIN
        for case in INDEX_CASES
        for ranking in index_rankings(case, draw_data(case, 0), numpy_runner.run)
    )


def test_mla_case_table_covers_the_issue():
    """With and without q_lora_rank, RoPE and YaRN; GQA-shaped, cross-attention, a window and sinks;
    each case expanded and absorbed."""
    variants = [dict(c.variants) for c in MLA_CASES]
    assert any("q_lora_rank" in v for v in variants) and any("q_lora_rank" not in v for v in variants)
    assert any("rope_theta" in v for v in variants) and any("rope_theta" not in v for v in variants)
    assert any(v.get("rope_scaling", {}).get("rope_type") == "yarn" for v in variants)
    assert any(c.k == 2 for c in MLA_CASES) and any(not c.self_attention and c.kdim for c in MLA_CASES)
    assert any("window" in v and v.get("sinks") for v in variants)
    assert {c.absorb for c in MLA_CASES} == {None, True}
    assert len({c.name.removesuffix("_absorbed") for c in MLA_CASES}) * 2 == len(MLA_CASES)


def test_case_table_covers_the_issue():
    assert len(CASES) >= 30
    assert {c.dtype for c in CASES} == set(TOLERANCES)
    masks = {c.mask for c in CASES}
    assert masks >= {"none", "bool_ts", "bool_bts", "bool_bnts", "bool_b1s", "float_ts", "rows_masked", "batch_masked"}
    assert any(c.causal and c.t == c.s for c in CASES) and any(c.causal and c.t < c.s for c in CASES)
    assert any(c.k == 1 for c in CASES) and any(c.k == 2 for c in CASES) and any(c.n == 1 for c in CASES)
    assert any(c.b == 1 for c in CASES) and any(c.t == 1 for c in CASES) and any(c.s == 1 for c in CASES)
    assert any(c.t == 0 for c in CASES) and any(c.s == 0 for c in CASES)
    variants = {name for c in CASES for name, _ in c.variants}
    assert variants == {
        "scale",
        "softcap",
        "window",
        "attention_chunk_size",
        "rope_theta",
        "rope_fraction",
        "rope_interleaved",
        "rope_scaling",
        "rope_sections",
        "rope_sections_interleaved",
        "qk_norm",
        "qk_norm_eps",
        "qk_norm_type",
        "qk_norm_bias",
        "sinks",
        "clip_qkv",
        "gate",
        "gate_activation",
        "keys_as_values",
        "value_norm",
        "query_scaling",
        "output_norm",
        "output_norm_eps",
        "qk_norm_after_rope",
    }  # fmt: skip (`kv_shared` needs two layers: shared_tests/test_sharing.py)
    windows = [dict(c.variants).get("window") for c in CASES]
    assert any(isinstance(w, int) for w in windows) and any(isinstance(w, tuple) for w in windows)  # both forms
    assert {dict(c.variants).get("qk_norm") for c in CASES} >= {"head", "per_head", "all"}
    assert any(c.positions == "sections" for c in CASES)
    assert any(len(c.variants) >= 3 and c.dtype == "float32" for c in CASES)  # combined, as today's models combine them
    assert {c.dtype for c in CASES if c.variants} == set(TOLERANCES)
    assert any(c.key_mask for c in CASES) and any(c.query_mask for c in CASES)
    assert {c.attention_bias for c in CASES} == {"none", "1nts", "bts"} and any(c.positions == "shifted" for c in CASES)
    assert any(isinstance(c.bias, tuple) for c in CASES)
    assert masks >= {"float64_far", "float_penalty"}


def _negate(keep):
    return keep if keep is None else ~keep


class TorchNoBias(TorchMultiHeadAttention):
    """The bias step dropped from the projections (but kept in the weight dict)."""

    def _project(self, x, kind):
        return torch_file.F.linear(x, getattr(self, kind).weight)

    def _project_fused(self, x):
        return tuple(
            self._split_heads(self._project(x, kind), h)
            for kind, h in (("query", self.num_heads), ("key", self.num_kv_heads), ("value", self.num_kv_heads))
        )


class TFNoBias(TFMultiHeadAttention):
    def _project(self, x, *kinds):  # several kinds: the fused q/k/v projection (`_project_fused`)
        kernels = [getattr(self, f"{kind}_kernel") for kind in kinds]
        return tf_file.tf.matmul(x, kernels[0] if len(kernels) == 1 else tf_file.tf.concat(kernels, axis=1))


def _torch_wrong_split(self, y, heads):
    b, length, _ = y.shape
    return y.reshape(b, length, self.head_dim, heads).permute(0, 3, 1, 2)  # heads taken as the inner axis


def _tf_wrong_split(self, y, heads):
    shape = tf_file.tf.shape(y)
    y = tf_file.tf.reshape(y, [shape[0], shape[1], self.head_dim, heads])
    return tf_file.tf.transpose(y, [0, 3, 1, 2])


MUTATIONS = {
    "torch_scale": (torch_file, "math", type("m", (), {"sqrt": staticmethod(lambda x: x)}), "mask_float_ts"),
    "tf_scale": (tf_file, "math", type("m", (), {"sqrt": staticmethod(lambda x: x)}), "mask_float_ts"),
    "torch_mask_polarity": (
        torch_file,
        "_split_mask",
        lambda m, t: (lambda k, b: (_negate(k), b))(*torch_file_split(m, t)),
        "mask_bool_bts",
    ),
    "tf_mask_polarity": (
        tf_file,
        "_split_mask",
        lambda m, t: (lambda k, b: (None if k is None else tf_file.tf.logical_not(k), b))(*tf_file_split(m, t)),
        "mask_bool_bts",
    ),
    "torch_head_split": (TorchMultiHeadAttention, "_split_heads", _torch_wrong_split, "cross"),
    "torch_inference_block_rows": (
        torch_file,
        "_batch_rows",
        lambda mask, rows: mask if mask is None or mask.dim() < 4 else mask[:1],  # every block reads batch element 0
        "mask_bool_bts",
    ),
    "tf_memory_efficient_rows": (
        tf_file,
        "_chunk_rows",
        lambda mask, start, size: tf_file_chunk_rows(mask, 0 * start, size),  # every chunk reads the first rows
        "mask_bool_bts",
    ),
    "tf_memory_efficient_backward": (
        tf_file,
        "_memory_efficient_attention",
        lambda q, k, v, *rest: tf_file_memory_efficient(q, tf_file.tf.stop_gradient(k), v, *rest),
        "cross",
    ),
    "tf_head_split": (TFMultiHeadAttention, "_split_heads", _tf_wrong_split, "cross"),
}
torch_file_split, tf_file_split = torch_file._split_mask, tf_file._split_mask
tf_file_chunk_rows, tf_file_memory_efficient = tf_file._chunk_rows, tf_file._memory_efficient_attention


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_broken_step_fails_the_report(name, monkeypatch, capsys):
    """A mutated layer fails the report, through the in-process paths (`--no-runtimes`: that each
    runtime column catches a broken layer is the test below; the dynamic exports are judged
    against the eager layer, mutated too, so they could not catch it)."""
    target, attribute, replacement, case_name = MUTATIONS[name]
    monkeypatch.setattr(target, attribute, replacement)
    assert parity.main(["--no-runtimes", "--case", case_name]) == 1
    assert "FAIL" in capsys.readouterr().out


@pytest.mark.parametrize("path", RUNTIME_PATHS)
def test_each_runtime_column_catches_a_broken_layer(path, monkeypatch):
    """The layer exported with its heads split wrongly fails its runtime's column against NumPy:
    the runtime runs the exported layer, so a broken step reaches it."""
    framework = path.split(":")[0]
    target, attribute, replacement, case_name = MUTATIONS[f"{framework}_head_split"]
    monkeypatch.setattr(target, attribute, replacement)
    case = CASES_BY_NAME[case_name]
    row, results = parity.run_case(case, paths=("numpy", path))
    assert set(results) == {"numpy", path}, row.failures  # the runtime ran, and what it gave is wrong
    assert row.diffs[parity.RUNTIMES_LABEL]["output"] > case.tolerance["output"]
    assert any(failure.startswith(f"{framework}/numpy output") for failure in row.failures), row.failures


@pytest.mark.parametrize(
    "classes", [{"torch_class": TorchNoBias}, {"tf_class": TFNoBias}], ids=["torch_bias", "tf_bias"]
)
def test_dropped_bias_fails_the_row(classes):
    """Through the in-process paths, as the mutations above (the runtimes' columns catching a broken
    layer: `test_each_runtime_column_catches_a_broken_layer`; these cases on every path:
    `test_case_in_parity`)."""
    for name in ("cross", "self_basic"):
        row, _ = parity.run_case(CASES_BY_NAME[name], paths=IN_PROCESS_PATHS, **classes)
        assert not row.passed, name


def test_report_passes_and_writes_json_and_plot(tmp_path, capsys):
    """Without the runtimes: `test_case_in_parity` runs these two cases through them, and
    `test_runtimes_run_every_float32_case_and_list_what_they_skip` the report with them."""
    out_json, out_png = tmp_path / "table.json", tmp_path / "heads.png"
    cases = ["--case", "gqa", "--case", "rows_fully_masked"]
    status = parity.main(["--no-runtimes", *cases, "--json", str(out_json), "--plot", str(out_png)])
    printed = capsys.readouterr().out
    assert status == 0
    assert "2/2 cases PASS, 0 FAIL" in printed
    table = json.loads(out_json.read_text())
    assert [row["case"] for row in table] == ["gqa", "rows_fully_masked"]
    assert all(row["passed"] for row in table)
    assert out_png.read_bytes().startswith(b"\x89PNG")


def test_device_option_runs_numpy_and_the_torch_paths(tmp_path, monkeypatch, capsys):
    """`--device` moves the PyTorch paths (here to "cpu:0", which takes the same branch as cuda)
    and leaves out TensorFlow and the runtimes; `--plot` needs TensorFlow."""
    monkeypatch.setenv("PARITY_TORCH_DEVICE", "cpu")  # restored after the test
    out_json = tmp_path / "table.json"
    assert (
        parity.main(["--device", "cpu:0", "--case", "mask_bool_bts", "--case", "decode_gqa", "--json", str(out_json)])
        == 0
    )
    assert "PyTorch paths on cpu:0" in capsys.readouterr().out
    attention, decode = json.loads(out_json.read_text())
    for row in (attention, decode):
        assert row["passed"] and row["diffs"]["torch/numpy"]["output"] is not None
        assert row["diffs"]["torch/tf"]["output"] is None and row["diffs"]["tf/numpy"]["output"] is None
    assert parity.main(["--device", "cuda", "--plot", str(tmp_path / "p.png")]) == 2
    assert "--plot compares PyTorch with TensorFlow" in capsys.readouterr().err


def test_report_ends_with_the_summaries_and_its_time_and_no_runtimes_skips_the_runtimes(tmp_path, capsys):
    """The last screen holds what matters: the two summary lines, then the time the report
    took; `--no-runtimes` leaves out the runtimes and the exports, on one line saying so."""
    out_json = tmp_path / "table.json"
    assert parity.main(["--no-runtimes", "--case", "gqa", "--case", "decode_gqa", "--json", str(out_json)]) == 0
    printed = capsys.readouterr().out.rstrip().splitlines()
    assert printed[-3:-1] == ["1/1 cases PASS, 0 FAIL", "1/1 decode cases PASS, 0 FAIL"]
    assert re.fullmatch(r"report took (\d+ min )?\d+ s", printed[-1])
    left_out = ", ".join((*RUNTIME_PATHS, *DYNAMIC_PATHS))
    assert f"  {left_out}: not run, --no-runtimes" in printed
    attention = json.loads(out_json.read_text())[0]
    assert attention["diffs"]["onnx+litert/numpy"]["output"] is None and "dynamic/eager" not in attention["diffs"]
    assert attention["diffs"]["torch/tf"]["output"] is not None


def test_unknown_device_is_an_error_naming_it(capsys):
    assert parity.main(["--device", "tpu9", "--case", "gqa"]) == 2
    assert "error: --device 'tpu9' is not a PyTorch device" in capsys.readouterr().err


IN_PROCESS_PATHS = ("numpy", "torch:sdpa", "torch:explicit", "tf:eager", "tf:function")  # the runtimes: test below
WEIGHT_LAYOUTS = {  # (constructor arguments, flags telling the heads)
    "gqa": ((16, 4), {"num_kv_heads": 2}, ["--num-heads", "4"]),
    "gqa_told_by_kv_heads": ((16, 4), {"num_kv_heads": 2}, ["--num-kv-heads", "2"]),
    "mqa_no_bias": ((16, 4), {"num_kv_heads": 1, "bias": False}, ["--heads", "4"]),
    "head_dim_kdim_vdim": ((24, 6), {"num_kv_heads": 2, "head_dim": 5, "kdim": 10, "vdim": 12}, ["--num-heads", "6"]),
}
USER_WEIGHT_CASES = ["cross", "self_basic", "mask_bool_bnts", "causal_t_lt_s", "float16_self"]
USER_WEIGHT_DECODE_CASES = ["decode_gqa", "decode_cross_widths", "decode_float16"]


@pytest.mark.parametrize("layout", sorted(WEIGHT_LAYOUTS))
def test_parity_tool_runs_user_weights_of_every_layout(layout, tmp_path, monkeypatch, capsys):
    """Every layout the layer accepts runs from its file; what cannot run is listed with why."""
    monkeypatch.setattr(parity, "PATHS", IN_PROCESS_PATHS)
    args, kwargs, heads = WEIGHT_LAYOUTS[layout]
    path = tmp_path / "mine.npz"
    np.savez(path, **TorchMultiHeadAttention(*args, **kwargs).export_weights())
    out_json = tmp_path / "table.json"
    cases = [flag for name in USER_WEIGHT_CASES + USER_WEIGHT_DECODE_CASES for flag in ("--case", name)]
    assert parity.main(["--weights", str(path), *heads, *cases, "--json", str(out_json)]) == 0
    printed = capsys.readouterr().out
    self_fits = "kdim" not in kwargs
    ran = {row["case"] for row in json.loads(out_json.read_text())}
    self_cases = {"self_basic", "decode_gqa"}  # key and value are the query: they need kdim == vdim == d_model
    assert ran == {"cross", "mask_bool_bnts", "causal_t_lt_s", "decode_cross_widths"} | (
        self_cases if self_fits else set()
    )
    assert "2 cases: float16 and bfloat16 tolerances are stated for the table's Glorot-scale weights" in printed
    if not self_fits:
        assert (
            "2 cases: key and value are the query there, so kdim == vdim == d_model; the file has kdim=10, vdim=12, d_model=24"
            in printed
        )


def test_regression_gqa_weights_with_empty_keys_prints_the_report(tmp_path, capsys):
    """`--weights` of a GQA layer died with an onnxruntime traceback on `torch:onnx`, case
    `empty_keys`, and printed no table; the runtime's refusal is now a listed skip."""
    path = tmp_path / "gqa.npz"
    np.savez(path, **TorchMultiHeadAttention(16, 4, num_kv_heads=2).export_weights())
    assert parity.main(["--weights", str(path), "--num-heads", "4", "--case", "empty_keys", "--verbose"]) == 0
    printed = capsys.readouterr().out
    assert "1/1 cases PASS, 0 FAIL" in printed
    assert re.search(
        r"torch:onnx +1 case \(empty_keys\): onnxruntime's shape inference refuses .* grouped key/value heads", printed
    )


FRESH_WEIGHT_SEEDS = range(4)  # torch seeds of fresh MultiHeadAttention(16, 4, num_kv_heads=2) weight files
ILL_CONDITIONED_CASES = ["large_scores", "large_scores_masked"]  # scores ~1e3: a near tie is ill-conditioned
CONDITIONING_PATHS = ("numpy", "torch:explicit", "tf:eager")  # output, weights and gradients of both frameworks


def _fresh_weight_file(tmp_path, seed):
    torch_file.torch.manual_seed(seed)
    path = tmp_path / f"fresh_{seed}.npz"
    np.savez(path, **TorchMultiHeadAttention(16, 4, num_kv_heads=2).export_weights())
    return path


def test_fresh_weight_files_pass_or_say_they_are_ill_conditioned(tmp_path, monkeypatch, capsys):
    """Fresh weight files, over several seeds: every row passes, and where the file makes a
    large-score case ill-conditioned (torch in float64 equals NumPy within 1e-12 there, but
    float32 rounding of the inputs alone moves the float64 reference past the SPEC tolerances)
    the row says so. Under the SPEC tolerances such a row FAILs, so the widening is what passes it."""
    monkeypatch.setattr(parity, "PATHS", CONDITIONING_PATHS)
    cases = [flag for name in ILL_CONDITIONED_CASES for flag in ("--case", name)]
    notes = 0
    for seed in FRESH_WEIGHT_SEEDS:
        out_json = tmp_path / f"table_{seed}.json"
        path = _fresh_weight_file(tmp_path, seed)
        assert parity.main(["--weights", str(path), "--num-kv-heads", "2", *cases, "--json", str(out_json)]) == 0
        rows, printed = json.loads(out_json.read_text()), capsys.readouterr().out
        assert all(row["passed"] for row in rows), seed
        for row in (row for row in rows if row["notes"]):
            notes += 1
            assert "    note: ill-conditioned with these weights: float32 rounding" in printed
            tol = CASES_BY_NAME[row["case"]].tolerance
            over_spec = [(p, q) for p, d in row["diffs"].items() for q, v in d.items() if v is not None and v > tol[q]]
            assert over_spec, (seed, row["case"])
    assert notes > 0  # some seed makes a case ill-conditioned, or this test checks nothing


def test_widened_tolerances_still_catch_a_bug_on_an_ill_conditioned_case(tmp_path):
    """The dropped-bias mutation fails the ill-conditioned row all the same."""
    for seed in FRESH_WEIGHT_SEEDS:
        weights, layout = parity.load_user_weights(_fresh_weight_file(tmp_path, seed), num_kv_heads=2)
        (case,), _ = parity.select_cases(["large_scores_masked"], layout, weights)
        data = {**make_data(case), "weights": weights}
        row, _ = parity.run_case(case, data, CONDITIONING_PATHS, conditioning=True)
        if row.notes:
            mutated, _ = parity.run_case(case, data, CONDITIONING_PATHS, conditioning=True, torch_class=TorchNoBias)
            assert mutated.notes and not mutated.passed
            return
    pytest.fail("no seed made large_scores_masked ill-conditioned")


class TorchRaises(TorchMultiHeadAttention):
    def forward(self, *args, **kwargs):
        raise RuntimeError("boom\nsecond line")


def test_parity_tool_turns_a_path_that_raises_into_an_error_row():
    case = CASES_BY_NAME["cross"]
    row, results = parity.run_case(case, paths=("numpy", "torch:sdpa", "tf:eager"), torch_class=TorchRaises)
    assert not row.passed and set(results) == {"numpy", "tf:eager"}
    table = parity.format_table([row])
    assert "    FAIL: torch:sdpa raised RuntimeError: boom" in table.splitlines()
    assert parity.summary([row]) == "0/1 cases PASS, 1 FAIL"


def test_parity_tool_fail_row_names_quantity_value_and_tolerance():
    case = CASES_BY_NAME["cross"]
    data = make_data(case)
    results = {path: parity.run(case, data, path) for path in ("numpy", "torch:explicit", "tf:eager")}
    results["torch:explicit"].output[0, 0, 0] += 1e-3
    table = parity.format_table([parity.compare(case, data, results)])
    lines = table.splitlines()
    assert lines[3].startswith("cross") and lines[3].endswith("FAIL")
    assert "    FAIL: torch/tf output 1.00e-03 > tolerance 1e-05" in lines
    assert "    FAIL: torch/numpy output 1.00e-03 > tolerance 1e-05" in lines
    assert not any("tf/numpy" in line for line in lines if "FAIL:" in line)


def test_parity_tool_zeros_failure_names_the_weight_it_found():
    case = CASES_BY_NAME["mask_bool_bts"]
    data = make_data(case)
    results = {path: parity.run(case, data, path) for path in ("numpy", "tf:eager")}
    first_removed = tuple(np.argwhere(parity.removed_positions(case, data))[0])  # (b, n, t, s)
    results["tf:eager"].weights[first_removed] = 2e-3
    row = parity.compare(case, data, results)
    assert not row.zeros
    assert "    FAIL: zeros: a removed position has weight 2.00e-03 > tolerance 0 (exactly 0)" in parity.format_table(
        [row]
    )


def test_report_rejects_weights_that_do_not_fit(tmp_path, capsys):
    path = tmp_path / "mine.npz"
    np.savez(path, **TorchMultiHeadAttention(24, 6).export_weights())
    assert parity.main(["--weights", str(path), "--num-heads", "5"]) == 2
    assert "--num-heads must divide the query width N*H=24" in capsys.readouterr().err
    assert parity.main(["--weights", str(path), "--num-heads", "6", "--num-kv-heads", "3"]) == 2
    assert "Received: --num-heads=6, --num-kv-heads=3" in capsys.readouterr().err
    assert parity.main(["--weights", str(path)]) == 2
    assert (
        "the shapes do not tell the number of heads (query width N*H=24, key/value width K*H=24): pass --num-heads"
        in capsys.readouterr().err
    )
    np.savez(path, query_kernel=np.zeros((4, 4)))
    assert parity.main(["--weights", str(path), "--num-heads", "2"]) == 2
    assert "missing key_kernel, value_kernel, output_kernel" in capsys.readouterr().err
    assert parity.main(["--weights", str(tmp_path / "absent.npz"), "--num-heads", "2"]) == 2
    assert "absent.npz" in capsys.readouterr().err


def test_nan_counts_as_a_failure():
    """The in-process paths only: `test_case_in_parity[cross]` runs this case on every path."""
    case = CASES_BY_NAME["cross"]
    data = make_data(case)
    results = {path: parity.run(case, data, path) for path in IN_PROCESS_PATHS}
    results["tf:eager"].output[0, 0, 0] = np.nan
    row = parity.compare(case, data, results)
    assert not row.passed
    assert any("tf" in failure and "output" in failure for failure in row.failures)


def test_runtimes_run_every_float32_case_and_list_what_they_skip(capsys):
    """Only bfloat16 (every runtime), float16 on LiteRT and zero-length sequences on the
    TensorFlow exports are skipped, each with its reason, and the report lists them under the
    table rather than dropping them."""
    non_empty = [case for case in CASES if case.dtype == "float32" and 0 not in (case.t, case.s)]
    assert all(not skip_reason(case, path) for case in non_empty for path in RUNTIME_PATHS)
    empty = [case for case in CASES if 0 in (case.t, case.s)]
    assert empty and all(not skip_reason(case, "torch:onnx") for case in empty)
    assert parity.main(["--case", "bfloat16_cross", "--case", "float16_self"]) == 0
    printed = capsys.readouterr().out
    lines = _not_run_lines(printed)
    assert lines["tf:litert"].startswith(
        "1 case: the TFLite converter refuses bfloat16 inputs; 1 case: TFLite builtin ops have no float16 BatchMatMul"
    )
    assert lines["torch:onnx"] == "1 case: NumPy has no bfloat16 to feed onnxruntime with"


def _not_run_lines(printed):
    """{path: what its line says} from the report's lines after "Not run"."""
    block = printed.split("\nNot run (")[1].split("\n\n")[0].splitlines()[1:]
    return dict(line.strip().split(None, 1) for line in block)


def _old_split_mask(mask, dtype):
    """The TensorFlow mask split before this fix: -inf reached tf.where's operand."""
    if mask is None:
        return None, None
    if mask.dtype == tf_file.tf.bool:
        return mask, None
    removed = tf_file.tf.math.is_inf(mask) & (mask < 0)
    additive = tf_file.tf.where(removed, tf_file.tf.zeros_like(mask), mask)
    return tf_file.tf.logical_not(removed), tf_file.tf.cast(additive, dtype)


def test_regression_tf2onnx_path_catches_inf_in_where(monkeypatch):
    """tf2onnx lowers tf.where to arithmetic, so a -inf operand gave NaN in onnxruntime while
    every in-process path stayed right: only the tf:onnx path can catch that, and does."""
    monkeypatch.setattr(tf_file, "_split_mask", _old_split_mask)
    case = CASES_BY_NAME["mask_float_ts"]
    data = make_data(case)
    in_process, _ = parity.run_case(case, data, paths=("numpy", "tf:eager", "tf:function"))
    assert in_process.passed, in_process.failures
    exported, results = parity.run_case(case, data, paths=("numpy", "tf:onnx"))
    assert not exported.passed
    assert not np.isfinite(results["tf:onnx"].output).all()


def test_regression_parity_run_logs_no_retracing(caplog):
    """Each case traced its own tf.function through `__call__`, which TensorFlow (counting traces
    per Python code, across cases) reported as retracing in a loop, in every full report."""
    cases = [CASES_BY_NAME[name] for name in ("cross", "gqa", "self_basic", "mask_bool_bts", "causal_t_lt_s", "mqa")]
    for case in cases:
        parity.run_case(case, paths=("numpy", "tf:function"))
    for name in ("decode_gqa", "decode_uneven_chunks", "decode_all_steps"):
        parity.run_decode_case(parity.DECODE_CASES_BY_NAME[name], paths=("numpy", "tf:function"))
    assert len(cases) > 5  # TensorFlow warns from the fifth trace of the same code on
    assert not [record for record in caplog.records if "retracing" in record.getMessage()]


DYNAMIC_GROUP_CASES = ("cross", "cross_s1", "cross_t1_decode")  # one export, three shapes beside its own


@pytest.mark.parametrize("path", runtimes.DYNAMIC_PATHS)
def test_dynamic_export_runs_at_every_shape_of_its_group_equal_to_eager(path):
    """One export with unknown batch and lengths per path serves the cases of its group (T, S
    and B differ) and its own shape, each within the output tolerance of the eager layer."""
    for name in DYNAMIC_GROUP_CASES:
        case = CASES_BY_NAME[name]
        row, _ = parity.run_case(case, paths=("numpy",), dynamic_paths=(path,))
        assert row.passed, row.failures
        assert row.diffs[parity.DYNAMIC_LABEL]["output"] <= case.tolerance["output"]
    assert sum(key[0] == path and key[1] == "cross" for key in runtimes.EXPORTS) == 1


def test_every_case_runs_a_dynamic_export_or_says_why():
    grouped = [case for case in CASES if runtimes.dynamic_group(case) is not None]
    assert {runtimes.dynamic_group(case) for case in grouped} == set(runtimes.DYNAMIC_GROUPS)
    assert len(grouped) > len(runtimes.DYNAMIC_GROUPS)  # some exports serve more than one case
    for case in CASES:
        reasons = {path: runtimes.dynamic_skip_reason(case, path) for path in runtimes.DYNAMIC_PATHS}
        if runtimes.dynamic_group(case) is None:
            assert all(reasons.values()) and any("DYNAMIC_GROUPS" in reason for reason in reasons.values())
        elif case.dtype == "float32" and 0 not in (case.t, case.s):
            assert set(reasons.values()) == {None}
        else:  # what the static exports cannot hold either (T = 0 or S = 0, float16 on LiteRT)
            assert any(reasons.values())


@pytest.mark.parametrize(
    ("case_name", "expected"),
    [
        ("cross", [{0: "batch", 1: "query_length"}, {0: "batch", 1: "key_length"}, {0: "batch", 1: "key_length"}]),
        ("key_and_query_masks", [{0: "batch", 1: "query_length"}, *[{0: "batch", 1: "key_length"}] * 2,
                                 {0: "batch", 1: "query_length", 2: "key_length"}, {0: "batch", 1: "key_length"},
                                 {0: "batch", 1: "query_length"}]),
        ("self_t1", [{0: "batch", 1: "query_length"}]),
    ],
)  # fmt: skip
def test_dynamic_dimensions_are_told_by_how_much_each_grew(case_name, expected):
    case = CASES_BY_NAME[case_name]
    grown = runtimes.export_shape_case(case)
    _, arrays = runtimes.call_arrays(case, make_data(case))
    _, grown_arrays = runtimes.call_arrays(grown, make_data(grown))
    assert runtimes.dynamic_dimensions(arrays, grown_arrays) == expected


def test_regression_tf2onnx_reshape_optimizer_breaks_unknown_lengths(monkeypatch):
    """With unknown lengths, tf2onnx's reshape_optimizer gave the key projection's split into
    heads the shape of the 2-D matmul before it, and onnxruntime refused every call; the
    dynamic tf:onnx export converts without that optimizer."""
    import tf2onnx.optimizer

    case = CASES_BY_NAME["cross"]
    monkeypatch.setattr(runtimes, "EXPORTS", {})
    monkeypatch.setattr(
        runtimes,
        "tf2onnx_dynamic",
        lambda function, signature: runtimes.quietly(
            lambda: tf2onnx.convert.from_function(function, input_signature=signature)
        )[0],
    )
    row, _ = parity.run_case(case, paths=("numpy",), dynamic_paths=("tf:onnx:dynamic",))
    assert not row.passed
    assert any(re.search(r"tf:onnx:dynamic raised .*Reshape", failure) for failure in row.failures)
