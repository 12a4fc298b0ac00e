"""``usp eval`` on what ``usp train`` leaves: the training output (its newest DCP
checkpoint) and the HF export, as one process (the command itself, in-process) and on 4
gloo ranks (the same set-up, agreement and checks on the harness's ranks): the same
perplexities and passkey accuracies; failures are one clear error on every rank."""

from __future__ import annotations

import io
import json
import math
import random
import string
import sys

import pytest
import torch
from launch_cases import usp_in_process

from usp.cli import build_parser
from usp.evaluation.cli import evaluate_target, prepare
from usp.train.config import load_train_config
from usp.train.trainer import train, user_errors

TIMEOUT = 180

CONFIG = """
[cluster]
nodes = 1
gpus_per_node = "auto"

[parallel]
ulysses = "auto"
ring = "auto"

[model]
preset = "tiny"

[data]
source = "synthetic"
synthetic_documents = 32
synthetic_length = 24
document_multiple = 8

[train]
steps = 2
global_batch = 2
seq_len = 64
lr = 3e-3
export = true

[eval]
files = ["held.jsonl"]
every = 2
"""

FLAGS = ["--lengths", "192,256", "--passkey", "--trials", "2", "--depths", "0,0.5,1"]
FLAGS += ["--buckets", "4", "--windows", "2", "--seed", "7", "--dtype", "float32"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A 2-step run in one process: checkpoints/step_000002 and hf/."""
    tmp = tmp_path_factory.mktemp("trained")
    rng = random.Random(5)
    texts = ["".join(rng.choices(string.ascii_lowercase + " .", k=200)) for _ in range(4)]
    (tmp / "held.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    (tmp / "job.toml").write_text(CONFIG)
    out = tmp / "run"
    train(load_train_config(tmp / "job.toml"), None, output_dir=out, stream=io.StringIO())
    assert (out / "checkpoints" / "step_000002").is_dir() and (out / "hf").is_dir()
    return tmp, out


def _targets(tmp, out) -> dict[str, list[str]]:
    """The demo's two outputs as usp eval sees them (the HF export without a config)."""
    config = str(tmp / "job.toml")
    return {
        "checkpoint": [str(out), "--config", config],
        "hf": [str(out / "hf"), "--tokenizer", "byte", "--data", str(tmp / "held.jsonl")],
    }


def _usp_eval(argv) -> int:
    """The command in this process (a world of 1)."""
    return usp_in_process("eval", *argv)


@pytest.fixture(scope="module")
def one_process(trained, tmp_path_factory):
    """``usp eval ... --json`` in this process on both targets: (report, output dir)."""
    tmp, out = trained
    reports = {}
    for name, argv in _targets(tmp, out).items():
        where = tmp_path_factory.mktemp(f"eval_{name}")
        stdout, saved = io.StringIO(), sys.stdout  # module scope: no capsys
        sys.stdout = stdout
        try:
            status = _usp_eval([*argv, *FLAGS, "--json", "--output", str(where)])
        finally:
            sys.stdout = saved
        assert status == 0
        reports[name] = (json.loads(stdout.getvalue()), where)
    return reports


def test_json_has_lengths_perplexity_by_bucket_and_passkey_by_depth(one_process):
    report, where = one_process["checkpoint"]
    assert "step_000002" in report["target"] and report["ranks"] == 1
    assert report["lengths"] == [192, 256]
    for length in ("192", "256"):
        ppl = report["perplexity"][length]
        assert ppl["bucket_starts"] == [0, int(length) // 4, int(length) // 2, 3 * int(length) // 4]
        assert len(ppl["values"]) == 4 and all(v > 1 for v in ppl["values"])
        assert set(report["passkey"][length]) == {"0", "0.5", "1"}
        assert all(0 <= a <= 1 for a in report["passkey"][length].values())
    assert report["perplexity"]["256"]["windows"] == 2 and report["passkey_trials"] == 2
    assert json.loads((where / "eval.json").read_text())["perplexity"] == report["perplexity"]
    plots = report["files"]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert plots["passkey.png"].startswith("skipped: matplotlib is not installed"), plots
    else:
        assert (where / "passkey.png").stat().st_size > 0
        assert (where / "perplexity.png").stat().st_size > 0


def test_the_hf_export_gives_the_checkpoints_results(one_process):
    # the export is float32 on CPU; --data names the [eval] file, --tokenizer the bytes
    (a, _), (b, _) = one_process["checkpoint"], one_process["hf"]
    assert a["perplexity"] == b["perplexity"] and a["passkey"] == b["passkey"]


def _evaluate_on_ranks(argvs):
    """``usp eval`` of each argv in turn on this rank (one launch, several runs)."""
    reports = []
    for argv in argvs:
        args = build_parser().parse_args(["eval", *argv])
        settings, job, _ = prepare(args)
        report, plan = evaluate_target(args, job, settings, user_errors())
        plan.topology.destroy()
        reports.append(report)
    return reports


def _close(a: dict, b: dict, tol: float = 1e-5) -> None:
    for length, ours in a["perplexity"].items():
        theirs = b["perplexity"][length]
        assert ours["tokens"] == theirs["tokens"] and ours["windows"] == theirs["windows"]
        for x, y in zip(ours["values"] + [ours["overall"]], theirs["values"] + [theirs["overall"]]):
            assert abs(x - y) <= tol * y, (length, x, y)
    assert a["passkey"] == b["passkey"]


#: the Gated DeltaNet families on 4 ranks in the "hf" launch, each on its own grid (2 key /
#: 4 value GDN heads and 4 query / 2 KV heads: over 2 Ulysses ranks, or 4 ring ranks whose
#: conv tails and states pass along the ring), zigzag (the layout without a config)
GDN_GRIDS = {"qwen3_5": (2, 2), "qwen3_5_moe": (1, 4)}


@pytest.mark.parametrize("target", ["checkpoint", "hf"])
def test_4_ranks_give_the_one_process_results(trained, one_process, distributed, request, target):
    """The training output (u2 x r2) and its HF export (2 replicas of sp 2) on 4 ranks give
    the one-process command's numbers; the "hf" launch also evaluates tiny Qwen3.5 and
    Qwen3.5-MoE checkpoints (:data:`GDN_GRIDS`), whose perplexity equals transformers'
    float64 model's within 1e-5."""
    tmp, out = trained
    argv = [*_targets(tmp, out)[target], *FLAGS, "--device", "cpu"]
    if target == "hf":
        argv += ["--ulysses", "1", "--ring", "2", "--dp", "2"]  # 2 replicas of sp 2
    else:
        argv += ["--ulysses", "2", "--ring", "2"]  # over the config's "auto"
    grids = GDN_GRIDS if target == "hf" else {}
    gdn = request.getfixturevalue("gdn_families") if grids else {}
    runs = [argv]
    for family, (ulysses, ring) in grids.items():
        runs.append([*_family_argv(gdn[family][0], tmp), "--device", "cpu",
                     "--ulysses", str(ulysses), "--ring", str(ring), "--dp", "1"])  # fmt: skip
    results = distributed.run(_evaluate_on_ranks, runs, world_size=4, timeout=TIMEOUT)
    reports = [r[0] for r in results]
    assert all(r["perplexity"] == reports[0]["perplexity"] for r in reports)
    assert all(r["passkey"] == reports[0]["passkey"] for r in reports)
    assert reports[0]["ranks"] == 4
    grid = "dp 0/2, ring 0/2, ulysses 0/1" if target == "hf" else "dp 0/1, ring 0/2, ulysses 0/2"
    assert grid in reports[0]["plan"], reports[0]["plan"]
    _close(reports[0], one_process[target][0])
    for index, (family, (ulysses, ring)) in enumerate(grids.items(), 1):
        ours = [r[index] for r in results]
        assert all(r["perplexity"] == ours[0]["perplexity"] for r in ours), family
        assert f"ring 0/{ring}, ulysses 0/{ulysses}" in ours[0]["plan"], ours[0]["plan"]
        _check_family_report(ours[0]["perplexity"]["64"], gdn[family][1], family)


def _error_on_ranks(argv_of_rank):
    import torch.distributed as dist

    args = build_parser().parse_args(["eval", *argv_of_rank[dist.get_rank()]])
    settings, job, _ = prepare(args)
    try:
        evaluate_target(args, job, settings, user_errors())
    except user_errors() as err:
        return f"{type(err).__name__}: {err}"
    return None


def test_data_missing_on_one_rank_is_one_error_everywhere(trained, distributed):
    tmp, out = trained
    argv = [str(out / "hf"), "--tokenizer", "byte", "--lengths", "64"]
    per_rank = [argv + ["--data", str(tmp / ("gone.jsonl" if r == 2 else "held.jsonl"))]
                for r in range(4)]  # fmt: skip
    messages = distributed.run(_error_on_ranks, per_rank, world_size=4, timeout=60)
    assert all(m == messages[0] for m in messages), messages
    assert "usp eval set-up failed on rank 2 of 4" in messages[0], messages[0]
    assert "gone.jsonl does not exist" in messages[0], messages[0]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["{tmp}/held.jsonl", "--lengths", "64"], "is not a directory"),
        (["{out}", "--lengths", "64"], "pass --config with the training config"),
        (["{out}/hf", "--tokenizer", "byte", "--lengths", "64"], "needs held-out documents"),
        (["{out}/hf", "--lengths", "64", "--data", "{tmp}/held.jsonl"], "--tokenizer byte|PATH"),
        (["{out}", "--config", "{tmp}/job.toml", "--lengths", "63"], "not a multiple of 2"),
        (["{out}", "--config", "{tmp}/job.toml", "--lengths", "2000"], "fewer than one window"),
        (["{out}", "--config", "{tmp}/job.toml", "--lengths", "96", "--passkey"], "at least 163"),
    ],
)
def test_errors_say_what_to_give(trained, capsys, argv, message):
    tmp, out = trained
    argv = [a.format(tmp=tmp, out=out) for a in argv]
    status = _usp_eval(argv)
    stderr = capsys.readouterr().err
    assert status == 2 and message in stderr, stderr
    assert stderr.count("\n") == 1, "one line, no traceback"


def test_a_grid_for_more_ranks_names_the_flags_that_fix_it(trained, capsys):
    """``usp eval OUTPUT --config CONFIG`` in one process with a u2 x r2 grid: one line,
    exit 2, naming the flags that run it here; with them it runs."""
    from cli_flags import assert_flags_are_the_commands

    tmp, out = trained
    grid = tmp / "grid.toml"
    grid.write_text(
        CONFIG.replace('ulysses = "auto"\nring = "auto"', "ulysses = 2\nring = 2\ndp = 1")
    )
    argv = [str(out), "--config", str(grid), "--lengths", "64", "--output", str(tmp / "grid")]
    status = _usp_eval(argv)
    stderr = capsys.readouterr().err
    assert status == 2 and stderr.count("\n") == 1 and "Traceback" not in stderr, stderr
    assert "ulysses(2) * ring(2) * dp(1) = 4 != the running job's world_size(1)" in stderr
    assert "give --ulysses 1 --ring 1 --dp 1" in stderr, stderr
    assert "torchrun --nproc-per-node 4 -m usp eval" in stderr, stderr
    ours = stderr.split("torchrun")[0]  # the rest is torchrun's command line
    assert assert_flags_are_the_commands(ours, "eval") == {"--ulysses", "--ring", "--dp"}
    assert _usp_eval([*argv, "--ulysses", "1", "--ring", "1", "--dp", "1"]) == 0
    capsys.readouterr()


def test_flag_values_are_checked(capsys):
    for argv, message in [
        (["x", "--lengths", "4096,abc"], "comma-separated integers"),
        (["x", "--lengths", "4096", "--depths", "0,2"], "numbers in [0, 1]"),
        (["x", "--lengths", "4096", "--trials", "0"], "expected an integer >= 1"),
    ]:
        with pytest.raises(SystemExit):
            build_parser().parse_args(["eval", *argv])
        assert message in capsys.readouterr().err


def test_without_matplotlib_the_plots_are_skipped_with_the_reason(
    one_process, monkeypatch, tmp_path
):
    from usp.evaluation.report import write_plots

    report, _ = one_process["checkpoint"]
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    files = write_plots(report, tmp_path)
    assert set(files) == {"perplexity.png", "passkey.png"}
    assert all(v == "skipped: matplotlib is not installed (pip install matplotlib, or usp[plot])"
               for v in files.values()), files  # fmt: skip
    assert not list(tmp_path.iterdir())


def test_a_hybrid_hf_directory_is_refused_in_one_line(tmp_path, capsys):
    """usp eval computes usp's families only: a Qwen3-Next export (Gated DeltaNet layers;
    Qwen3.5 is a usp family since, Qwen3-Next is not) is refused by name, exit 2, one
    line, before anything runs."""
    pytest.importorskip("transformers", minversion="5.24")
    from hybrid_cases import HYBRID, build

    build("qwen3_next", HYBRID["qwen3_next"]).save_pretrained(tmp_path / "qwen3_next")
    capsys.readouterr()  # transformers' progress bar of the save
    status = _usp_eval([str(tmp_path / "qwen3_next"), "--lengths", "16", "--tokenizer", "byte"])
    stderr = capsys.readouterr().err
    assert status == 2, stderr
    assert "Qwen3NextForCausalLM is not a usp model family" in stderr, stderr
    assert stderr.count("\n") == 1, "one line, no traceback"


def _family_checkpoint(directory, family):
    """A tiny HF checkpoint of ``family`` written by transformers (vocabulary 256: the byte
    tokenizer's) and transformers' float64 model of it (its reference loader)."""
    import gemma3_cases
    import granite_cases
    import qwen3_5_cases
    from model_cases import load_hf_reference, write_family_checkpoint

    if family == "gemma3":  # windows of 5 on layers 0 and 2, soft-capped logits
        ckpt = gemma3_cases.write_checkpoint(directory, "capped", seed=3, vocab_size=256)
        return ckpt, gemma3_cases.load_reference(ckpt)
    if family == "qwen3_5":  # Gated DeltaNet layers 0 and 2, gated attention on layer 1
        ckpt = qwen3_5_cases.write_checkpoint(directory, "biased", seed=3, vocab_size=256)
        return ckpt, qwen3_5_cases.load_reference(ckpt)
    if family == "qwen3_5_moe":  # the same layers, 4 experts and a shared one
        ckpt = qwen3_5_cases.write_moe_checkpoint(directory, seed=3, vocab_size=256)
        return ckpt, qwen3_5_cases.load_reference(ckpt)
    if family == "granitemoehybrid":  # Mamba-2 layers 0 and 2, attention without RoPE
        ckpt = granite_cases.write_checkpoint(directory, "nope", seed=3, vocab_size=256)
        return ckpt, granite_cases.load_reference(ckpt)
    ckpt = write_family_checkpoint(directory, family, seed=3, vocab_size=256)
    return ckpt, load_hf_reference(ckpt)  # gpt-oss: eager (transformers has no sdpa for it)


#: transformers' class of each family's tiny checkpoint
HF_CLASSES = {
    "gpt_oss": "GptOssForCausalLM",  # sliding windows of 6, sinks, experts
    "qwen3_moe": "Qwen3MoeForCausalLM",  # experts on layer 1, q/k norms, biases
    "gemma3": "Gemma3ForCausalLM",
    "qwen3_5": "Qwen3_5ForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForCausalLM",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
}


def _family_argv(ckpt, tmp) -> list[str]:
    """``usp eval`` of a tiny family checkpoint: two 64-token windows of the held-out file."""
    return [str(ckpt), "--tokenizer", "byte", "--data", str(tmp / "held.jsonl"), "--lengths",
            "64", "--windows", "2", "--buckets", "2", "--dtype", "float32"]  # fmt: skip


def _transformers_perplexity(reference, held: str) -> float:
    """transformers' own perplexity of the two 64-token windows ``usp eval`` scores: full
    logits of each window, the loss of its trained next tokens."""
    import torch.nn.functional as F

    from usp.evaluation.target import held_out_stream
    from usp.evaluation.tasks import window
    from usp.train.data import ByteTokenizer

    stream, target, _ = held_out_stream(ByteTokenizer(), data=[held])
    total, count = 0.0, 0
    with torch.no_grad():
        for index in range(2):
            ids = window(stream, 64, index)[None]  # [1, 64]
            logits = reference(ids, use_cache=False).logits[0, :-1]  # predicts ids[1:]
            labelled = window(target, 64, index)[1:]
            losses = F.cross_entropy(logits, ids[0, 1:], reduction="none")[labelled]
            total, count = total + losses.sum().item(), count + int(labelled.sum())
    return math.exp(total / count)


def _check_family_report(report: dict, expected: float, family: str) -> None:
    """Two windows, their predicting tokens per bucket, and transformers' perplexity."""
    assert report["windows"] == 2 and report["tokens"] == [64, 62], (family, report)
    assert abs(report["overall"] - expected) <= 1e-5 * expected, (family, report, expected)


@pytest.fixture(scope="module")
def gdn_families(trained, tmp_path_factory):
    """The Qwen3.5 and Qwen3.5-MoE checkpoints (``_family_checkpoint``) and transformers'
    float64 perplexity of their two windows: {family: (checkpoint, perplexity)}."""
    pytest.importorskip("transformers", minversion="5.24")
    tmp, _ = trained
    out = {}
    for family in GDN_GRIDS:
        ckpt, reference = _family_checkpoint(tmp_path_factory.mktemp(family) / family, family)
        out[family] = (ckpt, _transformers_perplexity(reference, str(tmp / "held.jsonl")))
    return out


@pytest.mark.parametrize("family", list(HF_CLASSES))
def test_a_family_hf_directory_gives_transformers_perplexity(trained, tmp_path, capsys, family):
    """``usp eval`` on a tiny checkpoint of each 2026 family written by transformers: the
    overall perplexity of two 64-token windows equals transformers' own (its float64
    reference: float64 norms, routers and Gated DeltaNet core) on the same windows, within
    1e-5 (usp eval runs float32); the per-bucket token counts are the windows'
    predicting tokens. (Qwen3.5 and Qwen3.5-MoE on 4 ranks: the "hf" launch above.)"""
    pytest.importorskip("transformers", minversion="5.24")
    import transformers

    tmp, _ = trained
    ckpt, reference = _family_checkpoint(tmp_path / family, family)
    assert type(reference) is getattr(transformers, HF_CLASSES[family])
    capsys.readouterr()
    argv = [*_family_argv(ckpt, tmp), "--json", "--output", str(tmp_path / "eval")]
    assert _usp_eval(argv) == 0
    report = json.loads(capsys.readouterr().out)["perplexity"]["64"]
    expected = _transformers_perplexity(reference, str(tmp / "held.jsonl"))
    _check_family_report(report, expected, family)


def test_a_forced_gdn_kernel_that_cannot_run_is_refused_in_one_line(
    trained, gdn_families, tmp_path, capsys
):
    """A training config whose ``[attention]`` forces fla (not installed, and this is a
    CPU) on a Qwen3.5 checkpoint: one line, exit 2, before the model is loaded."""
    tmp, _ = trained
    ckpt = gdn_families["qwen3_5"][0]
    config = tmp_path / "fla.toml"
    config.write_text(
        CONFIG.replace('preset = "tiny"', f'path = "{ckpt}"').replace(
            "[model]", '[attention]\nlinear_backend = "fla"\n\n[model]'
        )
    )
    argv = [*_family_argv(ckpt, tmp), "--config", str(config), "--output", str(tmp_path / "e")]
    capsys.readouterr()
    assert _usp_eval(argv) == 2
    stderr = capsys.readouterr().err
    assert stderr.count("\n") == 1 and "Traceback" not in stderr, stderr
    assert '[attention] linear_backend = "fla" cannot run the Gated DeltaNet recurrence here' in (
        stderr
    )
    assert 'set linear_backend = "auto"' in stderr, stderr
    assert not (tmp_path / "e" / "eval.json").exists()


def test_eval_output_goes_beside_an_hf_directory_never_into_it(tmp_path):
    """The default --output: eval/ in a training output, eval/step_N for one checkpoint,
    and for an HF directory (a run's hf/ export, a downloaded model) DIR-eval beside it, so
    the model directory holds what its writer put there."""
    from argparse import Namespace

    from usp.evaluation.cli import output_dir
    from usp.evaluation.target import Target

    run = tmp_path / "run"
    default = Namespace(output=None)
    hf = Target(run / "hf", None, hf_dir=run / "hf", model_dir=run / "hf")
    assert output_dir(default, hf) == run / "hf-eval"
    step = run / "checkpoints" / "step_000002"
    assert output_dir(default, Target(step, None, checkpoint=step)) == run / "eval" / step.name
    assert output_dir(default, Target(run, None, checkpoint=step)) == run / "eval"
    assert output_dir(Namespace(output=str(tmp_path / "x")), hf) == tmp_path / "x"


def test_the_launcher_form_gives_the_one_process_results(trained, one_process, tmp_path):
    """``usp eval TARGET ... --nproc-per-node 2`` (usp train's launcher): the training
    output on u1 x r2 gives the one-process numbers in its eval.json; a bad length (63, odd:
    zigzag needs a multiple of 2 on one rank) on the same launcher with one worker ends with
    the rank's usp error as the last line, exit 2 (one worker: the error and its reporting
    are each rank's own; the launcher's pick of the first failing rank among several is
    tests/train/test_train_launcher.py's, 2 workers)."""
    from launch_cases import run_agents

    tmp, out = trained
    base = [sys.executable, "-m", "usp", "eval", *_targets(tmp, out)["checkpoint"]]
    good = [*base, *FLAGS, "--device", "cpu", "--ulysses", "1", "--ring", "2",
            "--output", str(tmp_path / "good"), "--nproc-per-node", "2"]  # fmt: skip
    bad = [*base, "--lengths", "63", "--device", "cpu", "--ulysses", "1", "--ring", "1",
           "--output", str(tmp_path / "bad"), "--nproc-per-node", "1"]  # fmt: skip
    ran, failed = run_agents([good, bad], tmp_path, timeout_s=300)
    assert ran.returncode == 0, ran.stdout
    report = json.loads((tmp_path / "good" / "eval.json").read_text())
    assert report["ranks"] == 2 and "ring 0/2, ulysses 0/1" in report["plan"], report["plan"]
    _close(report, one_process["checkpoint"][0])
    lines = [line for line in failed.stdout.splitlines() if line.strip()]
    assert failed.returncode == 2, failed.stdout
    assert lines[-1].startswith("usp eval") and "is not a multiple of 2" in lines[-1], lines[-1]
    assert "Traceback" not in failed.stdout and "ChildFailedError" not in failed.stdout
