"""Every registered method on any device and dtype, and one configuration serving concurrent requests.

- dtypes: every method runs end to end in float32, bfloat16 and float64 on the tiny models, and its
  exact invariant (a budget that covers the prompt reproduces full attention) holds with a tolerance
  that fits the dtype; GemFilter's selection equals a plain float64 reference.
- devices: prefill and compression run with the model and inputs on the `meta` device, where any
  CPU tensor that meets a model tensor raises; and a function mode audits every tensor factory
  call made from kvsieve's own code during whole generations (decoding included) for a `device=`.
- threads: one frozen configuration used from two threads at once gives exactly the sequential results.
- capture: what a CUDA graph records of a batch's decoding step runs no operator that reads a tensor back to
  the host (audited on a CPU with PyTorch's operators, as on CUDA).
- gpu (marked, deselected by default; `make test-gpu`): every method on CUDA in bfloat16.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import FakeTokenizer, build_model, make_prompt
from torch.overrides import TorchFunctionMode

from kvsieve import REGISTRY, KvsieveError, Sampling, fast_paths, method, run
from kvsieve.attention import attention_hooks
from kvsieve.engine.pipeline import prefill
from kvsieve.eval.host_reads import HostReadAudit, audit_prefill
from kvsieve.models import architecture
from kvsieve.prompt import Prompt
from kvsieve.select.scoring import filter_layer_qk

NAMES = list(REGISTRY)
# Per-head budgets read each head's count once after scoring (data, which a meta tensor has none of), and take no
# evict stage: on meta they are asked to refuse clearly instead.
PER_HEAD = [name for name, spec in REGISTRY.items() if spec.compress is not None and spec.compress.head_budgets]
DTYPES = [torch.float32, torch.bfloat16, torch.float64]
# Sizes that fit a 100-token prompt on the tiny models; each applies where a method has the field.
SMALL = [
    ("select.k", 32),
    ("compress.budget", 32),
    ("evict.budget", 32),
    ("feed.chunk", 32),
    ("feed.memory", 32),
    ("attention.segment", 16),
    ("attention.block", 4),
    ("attention.budget", 16),
]
# Settings under which each method keeps everything: it must then reproduce full attention.
COVERING = [
    ("select.k", 1.0),
    ("compress.budget", 512),
    ("evict.budget", 512),
    ("feed.chunk", 32),
    ("feed.memory", 512),
    ("attention.segment", 16),
    ("attention.block", 4),
    ("attention.budget", 512),
]
# Logit tolerance per dtype: bf16 keeps 8 mantissa bits, and chunked or sparse paths sum in another order.
TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-9, torch.bfloat16: 6e-2}


def spec_with(name: str, settings: list[tuple[str, object]]):
    spec = method(name)
    return spec.with_settings([(path, value) for path, value in settings if spec.has(path)])


def model_in(dtype: torch.dtype, arch: str = "llama", device: str = "cpu"):
    return build_model(arch, num_layers=3).to(device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", NAMES)
def test_every_method_runs_in_every_dtype(name, dtype, single_thread):
    model = model_in(dtype)
    result = run(model, FakeTokenizer(), make_prompt(100), method=spec_with(name, SMALL), sampling=Sampling(4))
    assert len(result.tokens) == 4 and result.prompt_tokens == 100
    chunked_to_36 = ("fm", "imdc", "fm-paper", "imdc-paper")
    expected = 100 if name in ("full", "critiprefill", "critiprefill-code") else 36 if name in chunked_to_36 else 32
    assert result.prefill_kv_length == expected


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", [n for n in NAMES if n != "full"])
def test_covering_budget_reproduces_full_attention_in_every_dtype(name, dtype, single_thread):
    model, prompt = model_in(dtype, arch="qwen2"), make_prompt(100)
    full = prefill(model, prompt, method=method("full"))
    ours = prefill(model, prompt, method=spec_with(name, COVERING))
    assert ours.prefilled.last_logits.dtype == dtype
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(ours.prefilled.last_logits, full.prefilled.last_logits, atol=tol, rtol=tol)
    if dtype != torch.bfloat16:  # greedy choices are exact where rounding cannot flip them
        sampling = Sampling(6)
        expected = run(model, FakeTokenizer(), prompt, method=method("full"), sampling=sampling).tokens
        assert run(model, FakeTokenizer(), prompt, method=spec_with(name, COVERING), sampling=sampling).tokens == (
            expected
        )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gemfilter_selection_equals_a_float64_reference_in_every_dtype(dtype, single_thread):
    model, prompt = model_in(dtype, arch="mistral"), make_prompt(120, tail_len=5)
    paper = {"select.queries": 1, "select.softmax": False, "select.block": 1}  # the last query's raw scores
    spec = method("gemfilter", {"select.k": 40, "select.layer": 1, **paper})
    selected = spec.select.select(model, prompt).indices
    query, keys = filter_layer_qk(model, prompt.ids, 1)  # the model's own post-RoPE q/k in its dtype
    query = query[:, -1]
    n_rep = query.shape[0] // keys.shape[0]
    raw = sum(keys[h // n_rep].double() @ query[h].double() for h in range(query.shape[0]))
    pooled = F.avg_pool1d(raw[None, None], kernel_size=5, stride=1, padding=2)[0, 0]
    body = pooled[:-5].topk(35).indices
    expected = torch.cat([body, torch.arange(115, 120)]).sort().values
    assert torch.equal(selected.cpu(), expected)


@pytest.mark.parametrize("name", [name for name in NAMES if name not in PER_HEAD])
def test_prefill_and_compression_stay_on_the_models_device(name):
    """On `meta`, a CPU tensor meeting the model's tensors raises; nothing may be created off-device."""
    model = model_in(torch.float32).to("meta")
    host = make_prompt(100)
    prompt = Prompt(host.ids.to("meta"), host.context_start, host.context_len)
    done = prefill(model, prompt, method=spec_with(name, SMALL))
    assert done.prefilled.last_logits.device.type == "meta"
    assert all(layer.keys.device.type == "meta" for layer in done.prefilled.cache.layers)


FACTORIES = {
    torch.arange,
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.tensor,
    torch.as_tensor,
    torch.rand,
    torch.randn,
    torch.randint,
    torch.linspace,
    torch.eye,
}
SOURCE = str(Path(__import__("kvsieve").__file__).parent)


class DeviceAudit(TorchFunctionMode):
    """Records every tensor factory call made from kvsieve's source without a `device=` argument."""

    def __init__(self) -> None:
        super().__init__()
        self.offenders: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and "device" not in kwargs:
            caller = sys._getframe(1)
            if caller.f_code.co_filename.startswith(SOURCE):
                self.offenders.append(f"{caller.f_code.co_filename}:{caller.f_lineno} {func.__name__}")
        return func(*args, **kwargs)


@pytest.mark.parametrize("name", NAMES)
def test_no_tensor_is_created_without_a_device_in_a_whole_generation(name, single_thread):
    model, prompt = model_in(torch.float32), make_prompt(100)
    spec = spec_with(name, SMALL)
    if spec.evict is None and name != "full" and name not in PER_HEAD:
        spec = spec.with_setting("evict", "a2sf").with_setting("evict.budget", 24)  # decoding eviction too
    with DeviceAudit() as audit:
        run(model, FakeTokenizer(), prompt, method=spec, sampling=Sampling(5, temperature=0.7, seed=1))
    assert audit.offenders == []


def test_the_audit_catches_a_tensor_created_without_a_device():
    with DeviceAudit() as audit:
        exec(compile("import torch\ntorch.arange(3)", SOURCE + "/fake_module.py", "exec"))
    assert len(audit.offenders) == 1 and "arange" in audit.offenders[0]


@pytest.mark.parametrize(
    "settings",
    [
        {"select": "gemfilter", "select.k": 96, "attention": "critiprefill", "attention.segment": 16,
         "attention.block": 4, "attention.budget": 16, "compress": "snapkv", "compress.budget": 32,
         "compress.policy.window": 4, "evict": "a2sf", "evict.budget": 24},
        {"feed": "chunked", "feed.chunk": 24, "feed.memory": 32, "feed.schedule": "adaptive",
         "feed.decremental": True, "feed.pruner": "tova", "evict": "h2o", "evict.budget": 20},
    ],
    ids=["gemfilter+critiprefill+snapkv+a2sf", "imdc-adaptive+h2o"],
)  # fmt: skip
def test_one_configuration_serves_two_threads_at_once(settings, single_thread):
    """Two requests run in lockstep, layer call by layer call (a barrier in an observer), so each stage's
    work for one request falls between the other's: any state kept in the shared configuration would mix."""
    model = build_model("qwen3", num_layers=6)
    spec = method("full", settings)
    prompts = [make_prompt(120, seed=11), make_prompt(120, seed=12)]
    sampling = Sampling(8)

    def one(prompt):
        result = run(model, FakeTokenizer(), prompt, method=spec, sampling=sampling)
        untimed = [{k: v for k, v in s.details.items() if "seconds" not in k} for s in result.stages]
        cache = [float(layer.keys.double().sum()) for layer in result.state.prefilled.cache.layers]
        return result.tokens, result.prefill_kv_length, untimed, cache  # the final cache, to the last bit

    sequential = [one(p) for p in prompts]
    barrier, results, errors = threading.Barrier(2), [None, None], []

    def lockstep(layer, query, key):
        barrier.wait(timeout=30)

    def worker(i):
        try:
            with attention_hooks(observers=[lockstep]):
                results[i] = one(prompts[i])
        except Exception as error:  # reported below: an exception in a thread would be lost
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    assert results == sequential and sequential[0] != sequential[1]


def test_an_unprepared_model_is_refused_with_the_fix():
    model = model_in(torch.float32)
    model.set_attn_implementation("sdpa")
    with pytest.raises(KvsieveError, match=r"kvsieve\.prepare\(model\)"):
        run(model, FakeTokenizer(), make_prompt(40), method=method("snapkv"), sampling=Sampling(2))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_static_step_as_a_gpu_records_it_reads_nothing_back_to_the_host(arch, monkeypatch, single_thread):
    """What a CUDA graph records for a batch (`StaticStep._forward`: the forward pass, the evicting rows' per-step
    scoring and their steady eviction, `steady_eviction`) runs on a CPU with PyTorch's operators only, as on CUDA
    (kvsieve's C++ kernels off), under an audit of every operator: none reads a tensor back to the host. The gpu
    test captures it; this one keeps a host read from reaching it unnoticed on machines without a GPU. Rows: full
    attention, two H2O rows (scored together), A2SF, TOVA and StreamingLLM, all steady; on gemma3 the sliding
    layers' rings (prompts past their window) as well."""
    from kvsieve.engine import static_step
    from kvsieve.engine.batch import DecodeBatch, Row
    from kvsieve.kernels import native
    from kvsieve.kv import cache as buffers
    from kvsieve.kv.cache import wrap_cache

    monkeypatch.setattr(native, "load", lambda: False)  # products, attention and eviction in PyTorch's operators
    evictions = []
    in_pytorch = buffers.steady_eviction
    monkeypatch.setattr(buffers, "steady_eviction", lambda *a: evictions.append(a[2]) or in_pytorch(*a))
    model = model_in(torch.float32, arch=arch)
    cases = [("full", {}, 30), ("h2o", {"evict.budget": 24}, 61), ("h2o", {"evict.budget": 24}, 55)]
    cases += [("a2sf", {"evict.budget": 24}, 47), ("tova", {"evict.budget": 20}, 40)]
    cases += [("streaming", {"evict.budget": 20}, 52)]
    batch = DecodeBatch(model, static=True)
    for name, settings, n in cases:
        done = prefill(model, make_prompt(n, seed=n), method=method(name, settings), reserve=8)
        layers = [(layer.keys, layer.values) for layer in done.prefilled.cache.layers]
        batch.add(Row(5, done.prefilled.next_position, done.state.evict), wrap_cache(model, layers))
    audits: list[HostReadAudit] = []
    forward = static_step.StaticStep._forward

    def audited(step):
        with HostReadAudit() as audit:
            audits.append(audit)
            return forward(step)

    monkeypatch.setattr(static_step.StaticStep, "_forward", audited)
    for _ in range(4):
        batch.step()
    assert len(audits) == 4 and sorted(evictions) == sorted(list(range(1, 6)) * 4)  # 5 rows' steady evictions
    assert all(audit.seen > 200 for audit in audits)
    assert [audit.offenders for audit in audits] == [[]] * 4


def test_the_capture_audit_catches_a_host_read_and_a_mask():
    x = torch.arange(6.0)
    with HostReadAudit() as audit:
        x.sum().item()
        x[x > 2]
        torch.tensor([1, 2])
    kinds = [offender.split(".")[1] for offender in audit.offenders]
    assert kinds == ["_local_scalar_dense", "index", "lift_fresh"], audit.offenders


@pytest.mark.gpu
@pytest.mark.parametrize("name", NAMES)
def test_every_method_on_cuda_in_bfloat16(name):
    assert torch.cuda.is_available(), "the gpu tests need CUDA (run them with `make test-gpu` on a GPU machine)"
    model, prompt = model_in(torch.bfloat16, arch="llama", device="cuda"), make_prompt(100)
    result = run(model, FakeTokenizer(), prompt, method=spec_with(name, SMALL), sampling=Sampling(4))
    assert len(result.tokens) == 4
    full = prefill(model, prompt, method=method("full"))
    covered = prefill(model, prompt, method=spec_with(name, COVERING))
    assert covered.prefilled.last_logits.device.type == "cuda"
    tol = TOLERANCE[torch.bfloat16]
    torch.testing.assert_close(covered.prefilled.last_logits, full.prefilled.last_logits, atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graph_steps_give_the_eager_steps_logits(dtype, arch):
    """On CUDA the batch captures its step once and replays it: rows of full attention and of four evicting
    presets, two of them H2O (each evicting one entry per step inside the recorded step), teacher-forced on the
    same tokens, give the eager steps' logits at every step and end with the same entries, across a rebuild of
    the tables (more steps than their spare room, so a second capture); on gemma3 with the sliding layers' rings
    wrapping round their window inside the recorded step."""
    import copy

    from kvsieve.engine.batch import SPARE, DecodeBatch, Row
    from kvsieve.kv.cache import wrap_cache

    assert torch.cuda.is_available(), "the gpu tests need CUDA (run them with `make test-gpu` on a GPU machine)"
    model = model_in(dtype, arch=arch, device="cuda")
    steps = SPARE + 16
    cases = [("full", {}, 30), ("h2o", {"evict.budget": 24}, 61), ("a2sf", {"evict.budget": 24}, 47)]
    cases += [("tova", {"evict.budget": 20}, 40), ("streaming", {"evict.budget": 20}, 52)]
    cases += [("h2o", {"evict.budget": 24}, 55)]  # two H2O rows: scored together (vmap) inside the recording
    done = [prefill(model, make_prompt(n, seed=n), method=method(name, s), reserve=steps) for name, s, n in cases]
    tokens = torch.randint(3, 200, (steps,), generator=torch.Generator().manual_seed(3)).tolist()

    def decode(static: bool) -> tuple[list[torch.Tensor], DecodeBatch]:
        batch = DecodeBatch(model, static=static)
        for d in done:
            layers = [(layer.keys.clone(), layer.values.clone()) for layer in d.prefilled.cache.layers]
            batch.add(Row(0, d.prefilled.next_position, copy.deepcopy(d.state.evict)), wrap_cache(model, layers))
        logits = []
        for token in tokens:
            for row in batch.rows:
                row.token = token
            logits.append(batch.step().float())
        return logits, batch

    eager, eager_batch = decode(False)
    captured, batch = decode(True)
    assert batch.captures == 2 and batch.static_step.graph is not None
    expected = [30 + steps, 24, 24, 20, 20, 24]
    assert [batch.entries(i) for i in range(6)] == [eager_batch.entries(i) for i in range(6)] == expected
    tol = TOLERANCE[dtype]
    for a, b in zip(eager, captured, strict=True):
        torch.testing.assert_close(b, a, atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_cuda_graph_steps_give_the_eager_steps_logits(dtype, arch, monkeypatch):
    """`compiled=True` on CUDA: the step's forward pass compiled by inductor, then captured as a CUDA graph and
    replayed; three rows of full attention (padded to each other's lengths), teacher-forced over more steps than
    the tables' spare room (a second capture, the compiled graph reused at the new capacity), end with the same
    entries as the eager ordinary step and give its logits: in float32 to its tolerance; in bfloat16, where the
    fused kernels round less often than eager ones, no further from the float32 model's logits than eager is."""
    import copy

    from kvsieve.engine.batch import SPARE, DecodeBatch, Row
    from kvsieve.kv.cache import wrap_cache

    assert torch.cuda.is_available(), "the gpu tests need CUDA (run them with `make test-gpu` on a GPU machine)"
    model = model_in(dtype, arch=arch, device="cuda")
    steps, lengths = SPARE + 16, (30, 47, 61)
    tokens = torch.randint(3, 200, (steps,), generator=torch.Generator().manual_seed(5)).tolist()

    def decode(model, compiled: bool) -> tuple[torch.Tensor, DecodeBatch]:
        batch = DecodeBatch(model, static=compiled, compiled=compiled)
        for n in lengths:
            done = prefill(model, make_prompt(n, seed=n), method=method("full"), reserve=steps).prefilled
            batch.add(
                Row(0, done.next_position, None), wrap_cache(model, [(x.keys, x.values) for x in done.cache.layers])
            )
        logits = []
        for token in tokens:
            for row in batch.rows:
                row.token = token
            logits.append(batch.step().float())
        return torch.stack(logits), batch

    monkeypatch.setattr(fast_paths, "_current", fast_paths.FastPaths(compiled_steps=True))  # --compile-steps
    assert DecodeBatch(model).compiled and DecodeBatch(model).capture  # compiled and captured by default
    with fast_paths.using(cuda_graphs=False):
        assert DecodeBatch(model).compiled and not DecodeBatch(model).capture
    eager, eager_batch = decode(model, False)
    compiled, batch = decode(model, True)
    assert batch.captures == 2 and batch.static_step.graph is not None and batch.static_step.compiled
    expected = [n + steps for n in lengths]
    assert [batch.entries(i) for i in range(3)] == [eager_batch.entries(i) for i in range(3)] == expected
    if dtype == torch.float32:
        torch.testing.assert_close(compiled, eager, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    else:
        reference, _ = decode(copy.deepcopy(model).float(), False)
        assert (compiled - reference).abs().max() <= 1.5 * (eager - reference).abs().max()


@pytest.mark.gpu
def test_int8_weights_on_cuda_decode_as_their_dequantized_weights():
    """`--quantize int8` on CUDA (the dequantized product, inside the captured decoding step): the greedy answer of
    a bfloat16 model with int8 weights is the answer of the same model with the dequantized weights."""
    import copy

    from kvsieve.quantize import Int8Linear, quantize

    assert torch.cuda.is_available(), "the gpu tests need CUDA (run them with `make test-gpu` on a GPU machine)"
    model = model_in(torch.bfloat16, arch="llama", device="cuda")
    quantized = quantize(copy.deepcopy(model), "int8")
    twin = copy.deepcopy(model)
    for name, module in quantized.named_modules():
        if isinstance(module, Int8Linear):
            twin.get_submodule(name).weight.data = module.dequantized().to(torch.bfloat16)
    prompt, spec, sampling = make_prompt(100), method("h2o", {"evict.budget": 48}), Sampling(12)
    ours = run(quantized, FakeTokenizer(), prompt, method=spec, sampling=sampling)
    assert ours.tokens == run(twin, FakeTokenizer(), prompt, method=spec, sampling=sampling).tokens


def test_choosing_the_kept_entries_reads_nothing_back_to_the_host():
    """`keep_indices` (every compression's, eviction's and chunked feed's choice) protects the sinks and the recent
    tail without a boolean-mask index, whose size a GPU would have to send back to the host (a stall per layer)."""
    from kvsieve.compress.scorers import keep_indices

    scores = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    with HostReadAudit() as audit:
        kept = keep_indices(scores, 20, sinks=4, recent=6)
    assert audit.offenders == [] and audit.seen > 5
    assert kept[:, :4].tolist() == [[0, 1, 2, 3]] * 3 and kept[:, -6:].tolist() == [list(range(44, 50))] * 3


PREFILL_AUDITS = [
    ("full", {}),
    ("fm", {"feed.chunk": 64, "feed.memory": 64}),
    ("im", {"feed.chunk": 64, "feed.memory": 64}),
    ("imdc", {"feed.chunk": 64, "feed.memory": 64}),
    ("gemfilter", {"select.k": 64}),
    ("critiprefill", {"attention.segment": 32, "attention.block": 8, "attention.budget": 32}),
    ("snapkv", {"compress.budget": 64}),
    ("h2o", {"evict.budget": 64}),  # prompt scores summed inside the attention pass (A2SF eq. 5, alpha 1)
    ("a2sf-paper", {"evict.budget": 64}),  # alpha 0.2: most queries weigh 0 and are left out
]


@pytest.mark.parametrize(("name", "settings"), PREFILL_AUDITS, ids=[name for name, _ in PREFILL_AUDITS])
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_prefill_reads_nothing_back_to_the_host_inside_a_layer(arch, name, settings, single_thread):
    """Every prefill path (the chunked feeds, GemFilter's selection pass, CritiPrefill's plan, a one-shot
    compression, an eviction's accumulated prompt scores) runs under an audit of every operator: none inside a
    decoder layer reads back to the host, and outside the layers nothing reads back per chunk: on llama nothing at
    all; on gemma3 only transformers' own sliding cache layers' constructors (a CPU tensor each, once per prefill),
    as many for a prompt twice as long."""
    model = build_model(arch, num_layers=4, max_positions=512)
    spec = method(name, settings)
    audits = [audit_prefill(model, make_prompt(n, seed=n), spec) for n in (200, 400)]
    assert [audit.reads_in_layers for audit in audits] == [[], []]
    assert audits[0].reads_outside == audits[1].reads_outside  # none that grows with the chunks
    if arch == "llama":
        assert audits[0].reads_outside == []
    chunked = name in ("fm", "im", "imdc")
    assert audits[1].passes > audits[0].passes > 2 if chunked else audits[0].passes <= 2
    assert audits[0].passes <= audits[0].layer_calls <= 4 * audits[0].passes and audits[0].operators_per_layer > 10


@pytest.mark.parametrize("name", ["fm", "imdc"])
def test_a_chunked_feed_launches_a_handful_of_kernels_per_layer_and_chunk(name, single_thread):
    """Around each chunk's pass, pruning and moving the memory cost a layer a handful of kernels (gathering its keys
    and values, reading its angles from the move's table, re-rotating its keys: two products, a roll and a sum),
    the rest is done once for the layers that keep as many entries (ranking, positions, prompt indices, the table of
    angles): a model of 8 layers launches at most 8 kernels a chunk more per added layer than one of 4 on the same
    prompt, views not counted."""
    spec = method(name, {"feed.chunk": 64, "feed.memory": 64})
    prompt = make_prompt(400, seed=3)
    audits = [audit_prefill(build_model("llama", num_layers=n, max_positions=512), prompt, spec) for n in (4, 8)]
    assert audits[0].passes == audits[1].passes > 4
    per_layer = (audits[1].kernels_per_pass - audits[0].kernels_per_pass) / 4
    assert 2 <= per_layer <= 8, per_layer
    assert audits[0].kernels_per_pass < audits[0].operators_per_pass  # views are counted apart


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_chunked_feed_asks_the_rotary_embedding_once_per_kind_and_move(arch, single_thread):
    """The memory's re-rotation between chunks takes every layer's angles from one call of the rotary embedding per
    kind of layer (gemma3: its sliding and its global layers, which rotate with different bases), not one per
    layer: besides the model's own calls in each pass, one per kind for each move (every chunk but the last)."""
    model = build_model(arch, num_layers=6, max_positions=512)
    calls = []
    model.model.rotary_emb.register_forward_hook(lambda *_: calls.append(1))
    prefill(model, make_prompt(300, seed=2), method("full"))
    per_pass = len(calls)
    calls.clear()
    settings = {"feed.chunk": 64, "feed.memory": 64, "feed.question_guided": False}  # no question passes
    out = prefill(model, make_prompt(300, seed=2), method("fm", settings))
    passes = out.prefilled.details["steps"]
    kinds = len({architecture(model).rotary(j) for j in range(6)})
    assert kinds == (2 if arch == "gemma3" else 1) and passes == 5
    assert len(calls) == passes * per_pass + kinds * (passes - 1)
