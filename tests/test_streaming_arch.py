"""Layer streaming beyond language models: a diffusers DiT and a stack of LSTM layers stream their blocks' frozen
weights from a layer store and compute what the resident model computes (one step's gradients of what trains),
through the same engine as a causal LM, with the modality's Objective (its inputs, loss and batch weight); the
DiT trains through the runner with strategy=sparse_lora; the plan's memory of a DiT streamed under a budget a
quarter of its size is what the step takes (measured in a fresh process, as task=bench measures)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from onn.models.layers import discover
from onn.streaming.engine import StreamingEngine
from onn.streaming.store import LayerStore
from onn.training.classifier import ClassifierObjective

TOLERANCE = 1e-4


def tiny_dit(layers: int = 4, heads: int = 2, head_dim: int = 8, size: int = 8, patch: int = 2, rank: int = 8):
    """A DiT denoiser as the diffusion modality builds it, LoRA on every block's linears, output layers trained."""
    from onn.config.model import DenoiserConfig
    from onn.modalities.diffusion.module import build_denoiser
    from onn.modalities.diffusion.tasks import adapted

    model_cfg = DenoiserConfig(
        name="dit",
        architecture="dit",
        kwargs={
            "num_layers": layers,
            "num_attention_heads": heads,
            "attention_head_dim": head_dim,
            "patch_size": patch,
            "norm_num_groups": 4,
        },  # fmt: skip
        ema_decay=0.0,
    )
    torch.manual_seed(0)
    denoiser = build_denoiser(model_cfg, 1, [size, size])
    strategy = _sparse_lora(rank)
    config = type("C", (), {"model": model_cfg, "strategy": strategy})
    model = adapted(denoiser, config)
    for name, p in model.named_parameters():  # random adapters, so every one has a gradient
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model


def _sparse_lora(rank: int):
    from conftest import compose

    return compose("strategy=sparse_lora", "strategy.layers=all", f"strategy.lora.r={rank}").strategy


def diffusion_batches(count: int = 2, rows: int = 3, size: int = 8, seed: int = 1) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [
        {
            "sample": torch.randn(rows, 1, size, size, generator=g),
            "timestep": torch.randint(0, 1000, (rows,), generator=g),
            "noise": torch.randn(rows, 1, size, size, generator=g),
        }
        for _ in range(count)
    ]


def streamed_step(model, objective, batches, chunk_size, folder):
    engine = StreamingEngine(
        model, discover(model), LayerStore("disk", "float32", folder=folder), chunk_size, objective=objective
    )
    engine.offload()
    loss = engine.train_step(batches)
    engine.close()
    return loss


def resident_step(model, objective, batches):
    losses = []
    for batch in batches:
        loss = objective.loss(model(**objective.inputs(batch)), batch)
        (loss * objective.weight(batch) / sum(objective.weight(b) for b in batches)).backward()
        losses.append(loss.detach() * objective.weight(batch))
    return torch.stack(losses).sum() / sum(objective.weight(b) for b in batches)


def trained_grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}


@pytest.mark.parametrize("chunk_size", [1, 2])
def test_a_dit_streams_with_the_resident_gradients(tmp_path, chunk_size):
    """The DiT's output layers call block 0's timestep embedding after the blocks: the engine lends it from the
    store for the suffix, so its adapters get the gradient of both uses."""
    from onn.modalities.diffusion.module import NoisePrediction

    resident = tiny_dit()
    streamed = copy.deepcopy(resident)
    batches = diffusion_batches()
    want_loss = resident_step(resident, NoisePrediction(), batches)
    loss = streamed_step(streamed, NoisePrediction(), batches, chunk_size, tmp_path)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    want, got = trained_grads(resident), trained_grads(streamed)
    assert want.keys() == got.keys() and any("norm1.emb.timestep_embedder" in n for n in want)
    assert max(float((want[n] - got[n]).abs().max()) for n in want) <= TOLERANCE


@pytest.mark.parametrize("layers", [8, 1])
def test_an_lstm_stack_streams_with_the_resident_gradients(tmp_path, layers):
    """An LSTM has no linear layer for LoRA: its biases and the head train, its weight matrices stream. One
    bidirectional layer is one block (its two directions were taken for two, and streaming crashed on them)."""
    from onn.models.zoo.recurrent import AudioRNN

    torch.manual_seed(0)
    resident = AudioRNN(1, 10, 8, hidden=16, layers=layers, dropout=0.0)
    for name, p in resident.named_parameters():
        p.requires_grad_(name.startswith("classifier") or (name.startswith("layers") and "bias" in name))
    streamed = copy.deepcopy(resident)
    g = torch.Generator().manual_seed(2)
    batches = []
    for _ in range(2):
        x = torch.randn(4, 1, 8, 20, generator=g)
        x[1, :, :, 12:] = x.min()  # a shorter clip: silence after frame 12 (packed sequences of different lengths)
        batches.append({"x": x, "y": torch.randint(0, 10, (4,), generator=g)})
    want_loss = resident_step(resident, ClassifierObjective(F.cross_entropy), batches)
    loss = streamed_step(streamed, ClassifierObjective(F.cross_entropy), batches, min(2, layers), tmp_path)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    want, got = trained_grads(resident), trained_grads(streamed)
    assert want.keys() == got.keys() and sum("layers.0." in n for n in want) >= 2
    assert max(float((want[n] - got[n]).abs().max()) for n in want) <= TOLERANCE


def test_a_mixed_batch_streams_with_the_resident_gradients(tmp_path):
    """task.mixup: the batch blended with itself reversed, split into micro-batches by the engine. Each micro-batch
    carries its samples' partners' labels, so the streamed loss and gradients are the whole batch's resident ones,
    and they differ from the unmixed batch's."""
    from conftest import compose

    from onn.models.zoo.recurrent import AudioRNN
    from onn.training.classifier import Classifier

    torch.manual_seed(0)
    network = AudioRNN(1, 10, 8, hidden=16, layers=4, dropout=0.0)
    for name, p in network.named_parameters():
        p.requires_grad_(name.startswith("classifier") or (name.startswith("layers") and "bias" in name))
    module = Classifier(network, [str(c) for c in range(10)], compose().optim, {}, mixup=0.4)
    g = torch.Generator().manual_seed(2)
    x, labels = torch.randn(6, 1, 8, 20, generator=g), torch.tensor([0, 1, 2, 3, 4, 5])
    torch.manual_seed(1)
    batch = module.mixed_batch(x, labels)
    weight = float(batch["weight"][0])
    assert 0.05 < weight < 0.95 and (batch["y_mixed"] == labels.flip(0)).all()
    objective = module.objective()
    resident = copy.deepcopy(network)
    want_loss = resident_step(resident, objective, [batch])
    plain = objective.loss(resident(batch["x"]), {"x": batch["x"], "y": labels})
    assert abs(float(plain) - float(want_loss)) > 1e-3  # the partners' labels count
    micro_batches = [{k: v[i : i + 2] for k, v in batch.items()} for i in (0, 2, 4)]  # partners in other pieces
    loss = streamed_step(network, objective, micro_batches, 2, tmp_path)
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=1e-6)
    want, got = trained_grads(resident), trained_grads(network)
    assert want.keys() == got.keys() and max(float((want[n] - got[n]).abs().max()) for n in want) <= TOLERANCE


def page_faults_reallocating(mb: int = 1, times: int = 40) -> int:
    """Minor page faults of allocating, filling and freeing an `mb` MiB tensor `times` times: a buffer glibc maps
    on its own faults every page in anew each time; one from the heap reuses its pages."""
    import resource

    torch.ones(mb * 2**18)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(times):
        torch.ones(mb * 2**18)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="glibc's malloc settings: Linux")
@pytest.mark.slow  # moved to the slow tier: the fast suite stays under 10 minutes on 2 cores
def test_a_held_mmap_threshold_is_released_for_what_runs_next():
    """A streamed run holds glibc's mmap threshold low for its whole process; the runner releases it when the run
    ends, or a CNN trained next in the same process (a test worker, a notebook) mapped every activation anew. In a
    fresh process: a heap with large free chunks (this worker's) serves a buffer from them whatever the threshold."""
    import subprocess
    import sys

    code = (
        "from test_streaming_arch import page_faults_reallocating as faults\n"
        "from onn.hardware.memory import hold_mmap_threshold, release_mmap_threshold\n"
        "hold_mmap_threshold(); held = faults(); release_mmap_threshold(); print(held, faults())"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, capture_output=True, text=True)
    held, released = (int(n) for n in out.stdout.split())
    assert held > 40 * 200 and released < held / 10, (held, released)


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="glibc's malloc settings: Linux")
@pytest.mark.slow  # moved to the slow tier: the fast suite stays under 10 minutes on 2 cores
def test_building_a_model_into_the_store_leaves_the_steps_activations_in_the_heap():
    """A language model's build into the layer store holds glibc's mmap threshold at 1 MiB (its blocks' weights
    come and go) and lets it go after: held on, every activation of a MiB or more was mapped anew at each
    step (llama_small's streamed step ran 1.5x the time its plan predicted, in task=bench's fresh process)."""
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from conftest import compose\n"
        "from test_streaming_arch import page_faults_reallocating as faults\n"
        "from onn.streaming.loader import load_into_store\n"
        "from onn.streaming.store import LayerStore\n"
        "load_into_store(compose('model=llama_tiny').model, torch.float32, None, LayerStore('cpu', 'float32'))\n"
        "print(faults(mb=2))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).parent, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) < 40 * 512 / 10  # mapped anew: 512 pages a buffer, every time


@pytest.mark.modalities
@pytest.mark.slow
def test_a_streamed_dit_trains_through_the_runner_and_samples_from_its_checkpoint(tmp_path):
    """strategy=sparse_lora on a DiT: the plan streams its blocks, the loss falls, and the checkpoint (adapters and
    output layers; the frozen base is the seed's) draws samples and exports, resident."""
    from test_diffusion import run, write_images

    images = write_images(tmp_path / "pictures")
    threads = torch.get_num_threads()
    metrics, run_dir = run(
        tmp_path,
        "model=dit_small",
        "model.ema_decay=0",
        "model.kwargs={num_layers: 4, num_attention_heads: 2, attention_head_dim: 8, patch_size: 2,"
        " norm_num_groups: 4}",
        f"data.source={images}",
        "strategy=sparse_lora",
        "strategy.layers=all",
        "strategy.streaming.store=disk",
        "strategy.streaming.chunk_size=1",
        "trainer.max_steps=8",
        "task.samples=2",
        "export=onnx",
    )
    assert metrics["streaming"] == {"chunk_size": 1, "store": "disk"}
    assert metrics["train/loss_final"] < metrics["train/loss_initial"]
    # the run held glibc's mmap threshold low (activations unmapped when freed); the runner gave it back
    assert page_faults_reallocating() < 1000
    assert torch.get_num_threads() == threads  # its plan, for an 8-core preset, set torch's threads for the run only
    assert (run_dir / "samples.png").is_file() and metrics["export/max_abs_diff"] < 1e-3
    infer, _ = run(tmp_path, "task=infer", f"ckpt={run_dir}", "task.samples=2", name="infer")
    assert infer["samples/count"] == 2


@pytest.mark.slow  # two fresh interpreters import torch and diffusers: ~35 s on two shared cores
def test_the_streamed_architectures_bench_writes_its_figures(tmp_path):
    """recipe=bench_streamed_arch at toy sizes: for the DiT and the LSTM stack, the plan's step memory beside each
    measured step (whether they agree within 15% is the recipe's figure at its own sizes, not asserted on noisy
    memory here), and one step's gradients streamed against resident."""
    from conftest import compose

    from onn.app import execute

    cfg = compose(
        "recipe=bench_streamed_arch",
        *(f"paths.outputs={tmp_path / 'outputs'}", f"paths.cache={tmp_path / 'cache'}", "hardware=cpu_16gb"),
        *("task.dit_layers=2", "task.dit_heads=1", "task.dit_batch=2", "task.steps=2"),
        *("task.lstm_layers=2", "task.lstm_hidden=16", "task.lstm_frames=8", "task.lstm_batch=2"),
    )
    metrics = execute(cfg, tmp_path)
    for arch in ("dit", "lstm"):
        f = {k.split("/")[-1]: v for k, v in metrics.items() if k.startswith(f"arch/{arch}/")}
        assert f["ratio"] == 4.0 and f["budget_mb"] * 4 == pytest.approx(f["blocks_mb"], abs=0.2)
        assert len(f["measured_mb"]) == len(f["error"]) == 2 and f["planned_mb"] > 0
        assert isinstance(f["fits"], bool) and f["peak_mb"] == max(f["measured_mb"])
        assert f["grad_max_abs_diff"] <= TOLERANCE
    assert "| lstm |" in (tmp_path / "bench_streamed_arch.md").read_text()


def test_lora_on_an_lstm_language_model_says_its_blocks_have_no_linear_layer():
    """char_lstm's blocks are LSTMs: strategy=sparse_lora (or lora) is one sentence naming strategy=full, not peft's
    error about target modules."""
    from onn.errors import UserError
    from onn.models.zoo.recurrent_lm import RecurrentLMConfig, RecurrentLMForCausalLM
    from onn.training.lora import apply

    model = RecurrentLMForCausalLM(RecurrentLMConfig(hidden_size=8, num_hidden_layers=2))
    with pytest.raises(UserError, match="no linear layer for LoRA adapters.*strategy=full"):
        apply(model, "sparse_lora", _sparse_lora(4), discover(model), [0, 1])


def test_the_streamed_architectures_bench_names_its_choices():
    from conftest import compose

    from onn.bench.registry import TASKS
    from onn.errors import UserError

    with pytest.raises(UserError, match=r"task.archs=\['unet'\]: choose among dit, lstm"):
        TASKS["bench_streamed_arch"].check(compose("recipe=bench_streamed_arch", "task.archs=[unet]"))


def test_the_streamed_architectures_bench_refuses_no_steps_and_a_budget_of_nothing():
    """task.steps=0 measured nothing and stopped on max() of no steps after all the work; task.budget_ratio=0
    divided by zero: each is one sentence naming its key, before anything runs."""
    from conftest import compose

    from onn.bench.registry import TASKS
    from onn.errors import UserError

    check = TASKS["bench_streamed_arch"].check
    with pytest.raises(UserError, match=r"task.steps=0: give a whole number of steps to measure, 1 or more"):
        check(compose("recipe=bench_streamed_arch", "task.archs=[lstm]", "task.steps=0"))
    for ratio in ("0", "-2.0"):
        with pytest.raises(UserError, match=rf"task.budget_ratio={ratio}.*: give a number above 0"):
            check(compose("recipe=bench_streamed_arch", f"task.budget_ratio={ratio}"))
    check(compose("recipe=bench_streamed_arch", "task.archs=[lstm]", "task.steps=1"))


class _Scaled(torch.nn.Module):
    """A weight of its own that no reset_parameters draws."""

    def __init__(self, width: int):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.randn(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


@pytest.mark.parametrize("store_kind", ["disk", "cpu"])
def test_random_blocks_drawn_into_the_store_equal_the_same_draw_in_memory(tmp_path, store_kind):
    """A streamed network of random weights is drawn block by block: the store receives each block's frozen
    weights, which stay empty placeholders in the network (one block in memory at a time), and drawing the same
    seed in memory (a streamed run's checkpoint evaluated resident) gives exactly the stored values; the trainable
    biases and the edges are the same too."""
    from onn.models.zoo.recurrent import AudioRNN
    from onn.streaming.seeded import draw, empty_network

    def build() -> torch.nn.Module:
        return AudioRNN(1, 3, [16, 20], hidden=8, layers=3, conv_widths=[4], dropout=0.0)

    def freeze_weights(network: torch.nn.Module) -> torch.nn.Module:
        for name, p in network.named_parameters():
            p.requires_grad_(not (name.startswith("layers.") and ".weight" in name))
        return network

    store = LayerStore(store_kind, "float32", folder=tmp_path / "store")
    streamed = freeze_weights(empty_network(build, 7))
    assert all(p.is_meta for p in streamed.parameters())  # nothing drawn yet
    draw(streamed, 7, None, store)
    resident = freeze_weights(empty_network(build, 7))
    draw(resident, 7)
    layer_map = discover(resident)
    for i, block in enumerate(layer_map.blocks):
        stored = store.read(i)
        for name, p in block.named_parameters():
            placeholder = discover(streamed).blocks[i].get_parameter(name)
            if p.requires_grad:
                assert torch.equal(placeholder, p)  # a trainable bias: drawn in both
            else:
                assert placeholder.numel() == 0 and torch.equal(stored[name], p)
    edges = {n: p for n, p in resident.named_parameters() if not n.startswith("layers.")}
    assert all(torch.equal(streamed.get_parameter(n), p) for n, p in edges.items())
    again = freeze_weights(empty_network(build, 8))
    draw(again, 8)
    assert not torch.equal(again.layers[0].forward_rnn.weight_ih_l0, resident.layers[0].forward_rnn.weight_ih_l0)

    def build_scaled() -> torch.nn.Module:  # a weight torch cannot draw again: the network is built whole
        return torch.nn.Sequential(torch.nn.Linear(4, 4), _Scaled(4), _Scaled(4), torch.nn.Linear(4, 2))

    whole = empty_network(build_scaled, 3)
    torch.manual_seed(3)
    assert all(torch.equal(a, b) for a, b in zip(whole.parameters(), build_scaled().parameters(), strict=True))
