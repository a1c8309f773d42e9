"""Tests for the benchmark / device-check scripts in bench/: the CUDA check skips cleanly without a GPU,
its CPU dry mode (every code path but the Triton calls) passes and detects a mismatch, and bench_kda's
FLOP count and prefix rule are right. Shell entry points run as subprocesses on one thread; the dry runs
call gpu_check.main() in this process (a subprocess would spend most of its time importing)."""

import importlib.util
import json
import os
import pathlib
import runpy
import subprocess
import sys
import types

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHON": sys.executable}  # the scripts run the interpreter running the tests


def _bench_module(name):
    # run_path registers the module while it runs, where its dataclasses look it up
    return types.SimpleNamespace(**runpy.run_path(str(ROOT / "bench" / f"{name}.py"), run_name=f"_bench_{name}"))


def _run(*command, timeout=120):
    result = subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    return result.returncode, result.stdout, result.stdout + result.stderr


def _needs_fla_naive():
    if importlib.util.find_spec("fla") is None or importlib.util.find_spec("einops") is None:
        pytest.skip("fla's naive KDA reference (flash-linear-attention + einops) is not installed")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the path taken without a GPU")
def test_gpu_check_skips_without_cuda():
    code, stdout, output = _run("bash", "bench/gpu_check.sh")
    assert code == 0, output
    assert stdout.startswith("SKIP: no CUDA device"), output


@pytest.fixture
def gpu_check(monkeypatch):
    """bench/gpu_check.py imported into this process, with everything its main() changes put back afterwards:
    it switches the KDA layers' kernels while a model runs, sets TRITON_F32_DEFAULT and the thread count."""
    _needs_fla_naive()

    # why: fla's naive reference in exact fp32 under the Triton interpreter
    monkeypatch.setenv("TRITON_F32_DEFAULT", "ieee")
    threads = torch.get_num_threads()
    yield _bench_module("gpu_check")
    torch.set_num_threads(threads)


def test_gpu_check_dry_run_passes(gpu_check, capsys):
    code = gpu_check.main(["--device", "cpu", "--dry", "--threads", "1"])
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    for heading in ("== a. ops", "== b. model", "== d. paths", "== f. segments", "== c. speed", "decode step",
                    "padded decode, sdpa"):
        assert heading in stdout, stdout
    assert "KDA calls reaching fla kernels: torch run 0, fla run" in stdout
    summary = stdout.strip().splitlines()[-1]
    assert summary.startswith("PASS:") and " 0 failed, 0 not run" in summary, stdout


def test_gpu_check_dry_run_detects_a_mismatch(gpu_check, capsys):
    """A 5% error in the 'fla' side's outputs must fail every check, in fp32 and bf16 alike."""
    code = gpu_check.main(["--device", "cpu", "--dry", "--threads", "1", "--sections", "ops", "--dry-fault", "0.05"])
    stdout = capsys.readouterr().out
    assert code == 1, stdout
    assert stdout.strip().splitlines()[-1].startswith("FAIL: 0 passed"), stdout


def test_gpu_check_budget_exhausted_is_not_a_pass(gpu_check, capsys):
    code = gpu_check.main(["--device", "cpu", "--dry", "--sections", "ops,model", "--budget", "0"])
    stdout = capsys.readouterr().out
    assert code == 3, stdout
    assert stdout.strip().splitlines()[-1].startswith("INCOMPLETE: 0 passed, 0 failed"), stdout


def test_gpu_check_leaves_the_kda_layers_alone(gpu_check):
    """The model section switches the KDA layers onto fla's side only while a run lasts (also when it raises)."""
    import transformers_k3.modeling_kimi_k3 as kda_layer
    from transformers_k3.ops.kda import chunk_kda, fused_recurrent_kda

    ours = (chunk_kda, fused_recurrent_kda)
    sides = gpu_check.install_kernels(True, 0.0)
    with pytest.raises(RuntimeError, match="inside"):
        with sides.kda_backend("fla"):
            assert kda_layer._delta_rule_kernels(torch.device("cpu"), None) != ours
            raise RuntimeError("inside")
    assert kda_layer._delta_rule_kernels(torch.device("cpu"), None) == ours


def test_kda_flop_count_matches_a_counted_naive_run():
    """fla's naive_chunk_kda does exactly the chunked algorithm's products except the triangular inverse
    (an elementwise loop there), so torch's FLOP counter must see the formula minus its 2/3 C^3 term."""
    _needs_fla_naive()
    from torch.utils.flop_counter import FlopCounterMode

    bench = _bench_module("bench_kda")
    naive = bench._load_fla_naive()
    for length, heads, key_dim, value_dim, chunk in [(128, 2, 16, 16, 64), (96, 3, 16, 32, 32)]:
        q, k, _, g, beta = bench._make_inputs(length, heads, key_dim)
        v = torch.randn(1, length, heads, value_dim)
        with FlopCounterMode(display=False) as counter:
            naive.naive_chunk_kda(q, k, v, g, beta, chunk_size=chunk, output_final_state=True)
        inverse = 2 / 3 * chunk**3 * (length // chunk) * heads
        expected = bench.chunked_kda_flops(length, heads, key_dim, value_dim, chunk) - inverse
        assert counter.get_total_flops() == pytest.approx(expected, rel=1e-12)
    assert bench.chunked_kda_flops(65, 1, 8, 8, 64) == bench.chunked_kda_flops(128, 1, 8, 8, 64)  # padded chunks
    assert bench.chunked_kda_flops(10, 3, 8, 4, None) == 6 * 8 * 4 * 3 * 10


def test_bench_prefix_rule():
    choose = _bench_module("bench_kda").choose_tokens
    assert choose(4096, 256, 0.1, max_seconds=20, max_bytes=1e12, per_token_bytes=0) == 4096  # fits
    assert choose(16384, 256, 1.0, max_seconds=20, max_bytes=1e12, per_token_bytes=0) == 5120  # time cap
    assert choose(16384, 256, 0.01, max_seconds=20, max_bytes=2**30, per_token_bytes=2**20) == 1024  # memory cap
    assert choose(16384, 256, 100.0, max_seconds=20, max_bytes=1e12, per_token_bytes=0) == 256  # never below the probe
    assert choose(100, 100, 100.0, max_seconds=1, max_bytes=1e12, per_token_bytes=0) == 100


@pytest.mark.slow
def test_bench_kda_runs_at_a_tiny_size():
    _needs_fla_naive()
    code, stdout, output = _run(
        sys.executable, "bench/bench_kda.py", "--threads", "1", "--configs", "2x16", "--lengths", "128",
        "--decode-steps", "4", "--max-seconds", "2", "--gemm-sizes", "64", timeout=300,
    )  # fmt: skip
    assert code == 0, output
    assert "failed:" not in stdout, output
    for label in ("ours chunk_kda", "in-tree chunk_kimi_delta_attention", "fla naive_chunk_kda",
                  "ours fused_recurrent_kda, T=1", "matmul roofline"):  # fmt: skip
        assert label in stdout, output


@pytest.mark.slow
def test_bench_moe_runs_at_a_tiny_size():
    code, stdout, output = _run(
        sys.executable, "bench/bench_moe.py", "--threads", "1", "--experts", "16", "--top-k", "4", "--tokens", "64",
        "--slow-tokens", "8", "--reps", "1", "--decode-calls", "10", "--latent", "32", "--intermediate", "8",
        timeout=300,
    )  # fmt: skip
    assert code == 0, output
    for label in ("== experts only ==", "== whole MoE layer ==", "== decode step: one forward call on 1 token(s)",
                  "K3 experts (ours)          k3_grouped_mm", "DeepseekV3MoE", "in-tree time / ours x"):  # fmt: skip
        assert label in stdout, output


def test_bench_latent_attention_runs_at_a_tiny_size():
    from transformers_k3.ops import cpu_kernel

    if cpu_kernel.library() is None:
        pytest.skip("the CPU kernels are not built here")
    code, stdout, output = _run(
        sys.executable, "bench/bench_latent_attention.py", "--contexts", "100", "1100", "--reps", "2",
        "--bandwidth-gib", "0.0625", timeout=300,
    )  # fmt: skip
    assert code == 0, output  # (it also checks the two computations agree)
    assert "| float32 | 1,100 |" in stdout and "| bfloat16 | 100 |" in stdout, output


def test_memory_layouts_arithmetic_matches_the_model_and_its_cache():
    """bench/memory_layouts.py's counts against what the model and the hybrid cache hold: its parameter classes
    add up to the model's parameters (the full config on the meta device: the release's 2.8T), and its cache
    formula gives the bytes a real cache holds after a forward of the tiny model."""
    from transformers_k3 import KimiK3Config, KimiK3ForCausalLM, KimiK3TextConfig, KimiK3VisionConfig

    layouts = _bench_module("memory_layouts")
    full = KimiK3Config(vision_config=KimiK3VisionConfig())
    counts = layouts.count_parameters(full)
    assert 2.7e12 < counts.total < 2.9e12 and counts.routed > 0.97 * counts.total
    tiny = KimiK3TextConfig.tiny()
    model = KimiK3ForCausalLM(tiny).eval()
    assert layouts.count_parameters(tiny).total == sum(p.numel() for p in model.parameters())
    with torch.no_grad():
        cache = model(torch.randint(3, tiny.vocab_size, (1, 10)), use_cache=True).past_key_values
    latent = sum(layer.latent.shape[-1] * layer.latent.element_size() for layer in cache.layers
                 if hasattr(layer, "latent"))
    state = sum(t.numel() * t.element_size() for layer in cache.layers if not hasattr(layer, "latent")
                for t in (layer.conv_state, layer.recurrent_state))
    assert layouts.cache_sizes(tiny, torch.float32, torch.float32) == (latent, state)
    code, stdout, output = _run(sys.executable, "bench/memory_layouts.py", "--markdown")
    assert code == 0, output
    assert "| 1 node, 8 GPUs | 8 x 8 |" in stdout


def test_bench_startup_compares_two_trees():
    code, stdout, output = _run(sys.executable, "bench/bench_startup.py", "--base", "HEAD", "--rounds", "1",
                                timeout=600)
    assert code == 0, output
    rows = [line for line in stdout.splitlines() if line.startswith("| ") and " s |" in line]
    assert len(rows) == 3 and all(float(row.rsplit("|", 2)[1]) > 0 for row in rows), stdout


def test_bench_long_context_runs_the_k3_featured_model():
    """--model-kind k3 builds the bench model with every K3 feature on and prints its decode rows beside a
    comparison row (tiny context, one step: checks it runs, not its speed)."""
    from transformers_k3 import KimiK3TextConfig

    config = KimiK3TextConfig(**_bench_module("bench_long_context").k3_config_dict())
    assert config.use_attn_res and config.hidden_act == "situ" and config.mla_use_nope and config.mla_use_output_gate
    assert config.routed_expert_hidden_size < config.hidden_size and config.latent_moe_use_norm
    assert config.num_shared_experts >= 1 and config.gate_lower_bound is not None
    code, stdout, output = _run(
        sys.executable, "bench/bench_long_context.py", "--model-kind", "k3", "--contexts", "64", "--steps", "1",
        "--models", "ours", "qwen3next", timeout=600,
    )  # fmt: skip
    assert code == 0, output
    assert "failed:" not in stdout and "ours: k3" in stdout, output
    rows = [line.split() for line in stdout.splitlines() if line.split()[:1] == ["64"]]
    assert [row[1] for row in rows] == ["ours", "qwen3next"] and all(float(row[4]) > 0 for row in rows), stdout


def test_ab_eager_k3_decode_row_runs():
    """ab_eager's K3-featured decode row runs on this tree (a worker call; what it prints is a time, not checked)."""
    code, stdout, output = _run(sys.executable, "bench/ab_eager.py", "--worker", "k3_decode", "--reps", "1",
                                timeout=600)
    assert code == 0, output
    assert json.loads(stdout.strip().splitlines()[-1])["seconds"] > 0, output


def _table_rows(stdout):
    """A markdown table's rows by their first cell, each row's cells split on ``|``."""
    return {line.split("|")[1].strip(): line.split("|") for line in stdout.splitlines() if line.startswith("| ")}


def _bench_mxfp4(table):
    """bench_mxfp4's ``table`` at a tiny size (16 experts, top-4, 1 thread): its stdout and rows; it ran and
    printed that table's heading for the K3 bench model."""
    code, stdout, output = _run(
        sys.executable, "bench/bench_mxfp4.py", "--threads", "1", "--tables", table, "--experts", "16",
        "--top-k", "4", "--model-intermediate", "32", "--prompt-tokens", "4", "--decode-calls", "2", timeout=300,
    )  # fmt: skip
    assert code == 0, output
    assert f"## {table}: decode step of the K3 bench model (4 layers, 3 MoE" in stdout, output
    return stdout, _table_rows(stdout)


def test_bench_mxfp4_model_decode_runs_at_a_tiny_size():
    """bench_mxfp4's bench-model table (the K3 bench model with its experts packed, bf16 and fp32) runs, prints a
    row for each with the bytes a decode step reads (MXFP4: 4.25 bits a weight), and its packed model computes the
    bf16 model's function (both run in fp32; not its speed)."""
    stdout, rows = _bench_mxfp4("model")
    assert {"bf16", "packed", "fp32"} <= rows.keys(), stdout
    expert_mb = {name: float(rows[name][5]) for name in ("bf16", "packed", "fp32")}
    assert expert_mb["fp32"] == pytest.approx(2 * expert_mb["bf16"], rel=0.02), stdout
    assert expert_mb["packed"] == pytest.approx(expert_mb["bf16"] * 17 / 64, rel=0.02), stdout  # 4.25 bits / 16
    assert all(float(rows[name][2]) > 0 for name in ("bf16", "packed", "fp32")), stdout
    check = next(line for line in stdout.splitlines() if line.startswith("packed vs bf16 model, both run in fp32"))
    assert float(check.split(": ")[1].split()[0]) < 1e-5, stdout  # the packed model computes the bf16 one's function


def test_bench_mxfp4_stream_table_runs_at_a_tiny_size():
    """bench_mxfp4's stream table (the bench model exported in the release's layout, its experts streamed from the
    files) runs, reads per decode token exactly the ``k`` routed experts of each MoE layer, and its logits equal
    the same export loaded packed in RAM (not its speed)."""
    stdout, rows = _bench_mxfp4("stream")
    assert {"packed in RAM", "streamed, page cache", "streamed, from disk"} <= rows.keys(), stdout
    latent = _bench_module("bench_long_context").k3_config_dict()["routed_expert_hidden_size"]
    per_token = 3 * 4 * 3 * (latent * 32 // 2 + latent * 32 // 32)  # 3 MoE layers, top-4, w1 / w3 / w2
    for name in ("streamed, page cache", "streamed, from disk"):
        assert float(rows[name][4]) == pytest.approx(per_token / 1e6, abs=0.006), stdout
        assert float(rows[name][7]) == 0.0, stdout  # (the logits equal the packed model's)


@pytest.mark.slow
def test_bench_stream_limit_runs_at_a_tiny_size():
    """bench_stream_limit writes its release-layout checkpoint, decodes with the experts streamed under
    ``RLIMIT_DATA`` and reports what it read per token (exactly the ``k`` routed experts of each MoE layer), the
    limit and the control; it deletes the checkpoint (not its speed; at this size the limit cannot refuse the
    packed load)."""
    code, stdout, output = _run(
        sys.executable, "bench/bench_stream_limit.py", "--moe-layers", "3", "--experts", "16", "--top-k", "4",
        "--intermediate", "256", "--headroom-mb", "64", "--prompt-tokens", "4", "--tokens", "2", timeout=600,
    )  # fmt: skip
    assert code == 0, output
    directory = next(line for line in stdout.splitlines() if line.startswith("wrote ")).rsplit(" to ", 1)[1]
    assert not os.path.exists(directory), directory
    assert "fully loaded packed under the same limit: " in stdout, output
    rows = {line.split("|")[1].strip(): line.split("|") for line in stdout.splitlines() if line.startswith("| stream")}
    assert rows.keys() == {"streamed, page cache", "streamed, from disk"}, stdout
    latent = _bench_module("bench_long_context").k3_config_dict()["routed_expert_hidden_size"]
    per_token = 3 * 4 * 3 * (latent * 256 // 2 + latent * 256 // 32)  # 3 MoE layers, top-4, w1 / w3 / w2
    for row in rows.values():
        assert float(row[5]) == pytest.approx(per_token / 1e6, abs=0.06), stdout


@pytest.mark.slow
def test_bench_segments_runs_at_a_tiny_size():
    """bench_segments prints a memory row per trajectory length and mode (tiny trajectories: checks it runs and
    reports the state it keeps, not the memory)."""
    code, stdout, output = _run(sys.executable, "bench/bench_segments.py", "--contexts", "256", "--segment", "128",
                                timeout=600)  # fmt: skip
    assert code == 0, output
    rows = [line.split("|") for line in stdout.splitlines() if line.startswith("| 256 ")]
    assert [row[3].strip() for row in rows] == ["truncated", "exact"], stdout
    assert all(float(row[5]) > 0 for row in rows), stdout


@pytest.mark.slow
def test_bench_segment_training_runs_at_a_tiny_size():
    """bench_segment_training trains a short toy trajectory by each route and prints the held-out loss before and
    after (two steps each: checks it runs, not how far the loss falls)."""
    code, stdout, output = _run(sys.executable, "bench/bench_segment_training.py", "--length", "384", "--segment",
                                "128", "--steps", "2", "--replay-steps", "2", timeout=600)  # fmt: skip
    assert code == 0, output
    rows = _table_rows(stdout)
    assert {"truncated", "exact", "replay"} <= rows.keys(), stdout
    assert all(0 < float(rows[run][4]) < 10 for run in ("truncated", "exact", "replay")), stdout


def test_bench_mxfp4_lora_runs_at_a_tiny_size():
    """bench_mxfp4_lora (a LoRA training step over packed experts and over bf16 experts with PEFT's own expert LoRA)
    runs and prints a timed row for each (not their speed)."""
    code, stdout, output = _run(
        sys.executable, "bench/bench_mxfp4_lora.py", "--threads", "1", "--experts", "16", "--top-k", "4",
        "--latent", "64", "--intermediate", "64", "--tokens", "8", "--rank", "2", "--reps", "1", timeout=300,
    )  # fmt: skip
    assert code == 0, output
    rows = {line.split("|")[2].strip(): line.split("|") for line in stdout.splitlines() if line.startswith("| 8 ")}
    assert rows.keys() == {"bf16 frozen", "bf16 + LoRA", "packed frozen", "packed + LoRA"}, stdout
    assert all(float(row[3]) > 0 for row in rows.values()), stdout
