"""Smoke runs of every example and of the benchmark, a few steps each, so they cannot rot.
Full runs and their accuracy are recorded in the README, not asserted here."""

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMOKE_STEPS = "10"  # training steps; the greedy tokens of generate.py still win by logit margins of 2e-2 and more


def _run(args, timeout=300):
    result = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.parametrize("script", ["torch_model.py", "keras_model.py"])
def test_training_example_saves_and_reloads(script, tmp_path):
    out = _run([f"examples/{script}", "--steps", SMOKE_STEPS, "--out", str(tmp_path)])
    assert "held-out token accuracy" in out
    assert "reloaded model gives identical logits: True" in out
    assert len(list(tmp_path.iterdir())) == 1


def test_port_weights_example_gives_the_same_logits(tmp_path):
    out = _run(["examples/port_weights.py", "--steps", SMOKE_STEPS, "--out", str(tmp_path)])
    assert "predictions that agree: 100.0%" in out
    assert (tmp_path / "attention.npz").exists()


def test_visualize_example_writes_both_heatmaps(tmp_path):
    _run(["examples/visualize_attention.py", "--steps", SMOKE_STEPS, "--out", str(tmp_path)])
    for name in ("attention_heads.png", "attention_heads_causal.png"):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG")


def test_benchmark_quick_writes_results(tmp_path):
    # every framework, each Keras backend in a process of its own, long sequences and memory in fresh processes;
    # one round of one timed run each (`make bench ARGS=--quick`: 3 of 2), as the rows are what it checks
    command = ["-m", "bench.benchmark", "--quick", "--runs", "1", "--rounds", "1"]
    out = _run([*command, "--output", str(tmp_path / "results.md")], timeout=900)
    text = (tmp_path / "results.md").read_text()
    assert text in out  # printed and written
    assert "| quick B=2 T=S=32 E=32 N=4 | forward | PyTorch |" in text
    assert "keras MultiHeadAttention" in text and "| quick decode L=32 | TensorFlow |" in text
    assert "| quick B=2 T=S=32 E=32 N=4 | train step | TensorFlow ours |" in text
    assert "| quick B=2 T=S=32 E=32 N=4 | PyTorch | RoPE | forward |" in text
    assert "| quick B=2 T=S=32 E=32 N=4 | TensorFlow | sinks | train step |" in text
    assert "| quick B=2 T=S=32 E=32 N=4 | PyTorch | ours int8 |" in text
    assert "| 1 | MLA absorbed | 96 (5.3x less)" in text and "| 8 | MLA expanded | 96 (" in text  # (C + Hr) * 4 bytes
    assert "| quick B=2 T=S=32 E=32 N=4 | TensorFlow | keras MultiHeadAttention int8 |" in text
    assert "| 512, 8, 8 (64) | 4096 | 1088 | 1088 | 0.266 | 0.266 |" in text  # the int8 and fp8 caches' bytes
    assert "| quick B=2 E=32 N=4 L=64 |" in text  # their step
    for backend in ("tensorflow", "jax", "torch"):  # the Keras file on every backend, and its decoding step
        assert f"| quick B=2 T=S=32 E=32 N=4 | {backend} | train step |" in text
        assert f"| B=1 L=1024 E=32 N=4, T = 1 | {backend} |" in text
        assert f"| Keras file train step, KERAS_BACKEND={backend} | quick T=S=256 E=32 N=4 |" in text  # memory


def test_benchmark_quick_never_writes_the_recorded_results(capsys):
    """`make bench ARGS=--quick` used to overwrite the tracked bench/results.md with smoke numbers."""
    from bench import benchmark

    assert benchmark.output_path(quick=True) == ROOT / "out" / "bench_quick.md"
    assert benchmark.output_path(quick=False) == ROOT / "bench" / "results.md"
    assert benchmark.output_path(quick=True, output=Path("elsewhere.md")) == Path("elsewhere.md")
    with pytest.raises(SystemExit):
        benchmark.main(["--quick", "--output", str(ROOT / "bench" / "results.md")])
    assert "--quick results are smoke numbers" in capsys.readouterr().err
    assert "/out/" in (ROOT / ".gitignore").read_text().split()  # where quick runs write is not tracked


@pytest.mark.parametrize(
    "command", [["bench.cuda"], ["shared_tests.cuda_checks"], ["shared_tests.parity", "--device", "cuda"]], ids=str
)
def test_gpu_scripts_import_and_say_when_there_is_no_gpu(command):
    """They run on a CUDA machine only (docs/gpu.md); here they must import and refuse clearly,
    with status 2 (the parity report raised an AssertionError from torch, status 1)."""
    result = subprocess.run([sys.executable, "-m", *command], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "error: no CUDA device" in result.stderr


def test_generate_example_gives_identical_strings(tmp_path):
    out = _run(["examples/generate.py", "--steps", SMOKE_STEPS, "--out", str(tmp_path)])
    assert out.count("'Alice was") == 4 and out.count("'The rabbit-hole went") == 4
    assert "identical strings in all four: True" in out
    int8 = re.search(
        r"int8 KV cache, 32 tokens: the float cache's greedy tokens: (\w+); on the float cache's tokens the same "
        r"top-1 token at (\d+) of (\d+) steps .*; smallest top-1 logit margin (\S+), logits moved by at most (\S+)",
        out,
    )
    same, agree, steps, margin, moved = int8[1], int(int8[2]), int(int8[3]), float(int8[4]), float(int8[5])
    assert same == "True" and agree == steps == 64, int8[0]
    assert 0 < moved < margin / 2, int8[0]  # no logit pair can swap: the tokens are not a near tie's luck
    assert sorted(p.name for p in tmp_path.iterdir()) == ["attention_0.npz", "attention_1.npz"]


def _torchrun(args):
    """torchrun on 2 ranks, run once more where a rank died of SIGABRT: gloo's TCP transport can
    abort a rank, at teardown too, on a loaded machine ("terminate called without an active
    exception"; pytorch/pytorch#50701, docs/distributed.md). Any other failure, or a second abort,
    fails the test; the first abort is reported as a warning."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *args]

    def run():
        return subprocess.run(torchrun, cwd=ROOT, capture_output=True, text=True, timeout=300)

    result = run()
    if result.returncode != 0:
        assert "Signal 6 (SIGABRT)" in result.stderr, result.stdout + result.stderr
        warnings.warn(f"torchrun {' '.join(args)}: a rank died of SIGABRT; running it once more", stacklevel=2)
        result = run()
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.mark.parametrize("mode", ["ddp", "tp"])
def test_distributed_torch_example_runs_on_two_ranks(mode):
    out = _torchrun(["examples/distributed_torch.py", "--mode", mode, "--steps", "10"])
    assert f"{mode} on 2 ranks: held-out token accuracy" in out


def test_distributed_keras_example_runs_on_two_replicas():
    out = _run(["examples/distributed_keras.py", "--steps", "10"])
    assert "2 replicas: held-out token accuracy" in out


def test_distributed_keras_jax_example_agrees_with_one_device():
    out = _run(["examples/distributed_keras_jax.py", "--steps", "10"])
    assert "mesh {'batch': 2, 'model': 2}: query_kernel (64, 64) held as (64, 32)" in out
    assert "predictions that agree with one device: 100.0%" in out


def test_port_llama_example_gives_the_tokens_of_transformers(tmp_path):
    out = _run(["examples/port_llama.py", "--steps", SMOKE_STEPS, "--out", str(tmp_path)])
    assert out.count("'Alice was") == 4 and out.count("'The rabbit-hole went") == 4
    assert "identical tokens in all 4: True" in out


def test_port_minilm_example_agrees_four_ways():
    """The real all-MiniLM-L6-v2 checkpoint: Keras and NumPy built without torch, transformers, and
    transformers with the PyTorch layer swapped in give the same sentence embeddings within 1e-5."""
    out = _run(["examples/port_minilm.py"])
    assert "4 sentences padded to" in out
    assert "with torch or transformers imported: none" in out
    assert "all four agree within 1e-05: True" in out


def test_benchmark_sections_measure_apart_and_never_write_the_recorded_results(monkeypatch, tmp_path, capsys):
    """`python -m bench.sections variants int8` runs those sections of `make bench` alone (here at the
    quick size) into out/, leaving bench/results.md (one full run) alone."""
    from bench import benchmark, sections

    recorded = (ROOT / "bench" / "results.md").read_text()
    kept = {name: benchmark.VARIANTS[name] for name in ("sinks", "soft-capping")}  # every one: the quick run's test
    monkeypatch.setattr(benchmark, "VARIANTS", kept)
    monkeypatch.setattr(benchmark, "VARIANT_CONFIGS", [benchmark.QUICK[0]])
    monkeypatch.setattr(benchmark, "SOFTCAP_CONFIGS", [benchmark.QUICK[0]])
    monkeypatch.setattr(benchmark, "INT8_CONFIGS", [benchmark.QUICK[0]])
    monkeypatch.setattr(sections, "OUTPUT", tmp_path / "sections.md")
    assert sections.main(["variants", "int8", "--runs", "1", "--rounds", "1"]) == 0
    text = (tmp_path / "sections.md").read_text()
    assert "## variants" in text and "| quick B=2 T=S=32 E=32 N=4 | TensorFlow | sinks | train step |" in text
    assert "## int8" in text and "| quick B=2 T=S=32 E=32 N=4 | PyTorch | ours int8 |" in text
    assert (ROOT / "bench" / "results.md").read_text() == recorded


def test_softcap_paths_compares_the_tiles_and_blocks_with_the_plain_layer(capsys):
    """`python -m bench.softcap_paths` (docs/benchmark.md, "Key tiles") at the smoke size."""
    from bench import softcap_paths

    assert softcap_paths.main(["--quick", "--rounds", "1", "--tiles", "16x16/8x8"]) == 0
    table = capsys.readouterr().out
    assert "| tiles / plain (spread) | blocks / plain (spread) | tiles 16x16/8x8 / plain (spread) |" in table
    for causal in ("no", "yes"):
        for mode in ("forward", "train step"):
            assert f"| quick B=2 T=S=32 E=32 N=4 | {causal} | {mode} |" in table
