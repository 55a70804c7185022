"""Any Hugging Face decoder: thirteen families no adapter was written for train as their own
transformers model does, at pp 2, tp 2 and pp 2 x tp 2, under "auto" and their own HF plan
(float64, 3 AdamW steps, every parameter to 1e-9 but HF's float32 norms, below, the replica
check after every step), and six export from pp 2 x tp 2 into folders `from_pretrained` loads
with the pipe's logits. The suite runs pp 2 x tp 2 under "auto" (ZBV, 2 stages a rank), four
exports (two under their own plans) and the float64-norm cases; the campaign adds pp 2, tp 2
on one stage under both plans and pp 2 x tp 2 under their own plans (tests/tiers.py).

    family        what the generic path meets (`hf.structure`, `hf.glue`, tp)
    gemma         a scaled-embedding subclass (sqrt(D)), tied head: vocab-sharded with its scale
    gemma2        + final logit soft-capping (glue), attention soft-capping, alternating windows
    gemma3_text   + a rotary table per layer type, q / k norms
    phi3          fused qkv_proj (q | k | v of unequal widths: 4 q, 2 kv heads) and
                  gate_up_proj, a sliding window: "auto" shards both part by part
    phi           dropout between embedding and blocks (a pp-plan module), partial rotary
    olmo2         q / k RMSNorm over the whole projection width: under "auto" q and k are
                  column-sharded and the norm's mean of squares summed over tp
    granite       embedding multiplier and logits scaling (glue), residual multipliers
    cohere        logit scale (glue), per-head q / k LayerNorms (heads, head_dim): under tp
                  sharded by head with q / k (`flow_heads`), by either plan
    glm4          partial rotary, extra post-norms
    starcoder2    embedding dropout (glue), a sliding window, biases
    gpt_neox      other trunk names (embed_in, emb_dropout, final_layer_norm), parallel residual
    smollm3       no-rope layers (a per-layer list)
    granite_swa   attention sinks (heads,), viewed (1, heads, 1) against the heads: under tp
                  sharded by head (`flow_heads`), by either plan (its own names the parameter
                  'colwise'); alternating windows

The reference is the plain HF model on one device, fed the same micro-batches (2; gradient
accumulation): Gemma's and Cohere's norms compute in float32, so the gradient of their
weights, a float32 sum over the tokens of a micro-batch, depends on how the batch is split
(~1e-8 relative, HF's arithmetic, not the pipeline's); split alike, the rest is float64.
Sums tp changes too: Gemma 3's q / k norms (head_dim,) are applied to every head, so their
float32 gradient is a sum over heads, over this rank's heads under tp (then summed over tp in
float64); Cohere's per-head norms, cut to this rank's heads, give bit-equal weight gradients
on the same input, but float64 differences of ~1e-16 upstream (tp's reductions) cross a
float32 rounding, magnified by AdamW: those 4 weights of each agree to 1e-8 in their tp
layouts (measured 1.9e-9 and 1.4e-9). OLMo 2's q / k norm under "auto" sums the squares of
each rank's features in float32 and adds the ranks' sums: every weight agrees to 1e-6
(measured 2.0e-7). Every other parameter to 1e-9. That these are Hugging Face's float32 and
nothing else is shown by removing it: with their norm classes computing in float64, in the
reference and the ranks alike, every parameter of the three agrees to 1e-9 at tp 2
(`test_without_hfs_float32_norms_every_weight_agrees_to_1e_9_at_tp_2`).
"""

import contextlib
import functools
import importlib

import pytest
import torch

pytest.importorskip("transformers", reason="hybridpar.hf needs the optional extra hybridpar[hf]")

from hf_models import tiny
from spawn_cases import selected_ids, spawn_cases
from test_hf_pipe import _assert_same, _train
from test_hf_pipe import _reference as _hf_reference

import hybridpar

FAMILIES = ("gemma", "gemma2", "gemma3_text", "phi3", "phi", "olmo2", "granite", "cohere",
            "glm4", "starcoder2", "gpt_neox", "smollm3", "granite_swa")
CHUNKS = 2
# (pp, tp), balance (embedding, 2 blocks, norm, head), schedule, plan
LAYOUTS = [((2, 1), [2, 3], "1f1b", None), ((1, 2), [5], "gpipe", "auto"),
           ((1, 2), [5], "gpipe", "hf"), ((2, 2), [2, 1, 1, 1], "zbv", "auto"),
           ((2, 2), [2, 3], "1f1b", "hf")]
CASES = {f"{kind}-pp{g[0]}tp{g[1]}-{s}" + (f"-{p}" if p else ""): (kind, g, b, s, p)
         for kind in FAMILIES for g, b, s, p in LAYOUTS}
# export back to Hugging Face at pp 2 x tp 2 (its folder, then the pipe's logits): glue
# layers, a vocab-sharded tied head, other trunk names, per-head norms and sinks cut by head,
# a fused q | k | v of unequal widths
EXPORTS = {"granite": "hf", "gemma2": "hf", "gpt_neox": "auto", "cohere": "auto",
           "granite_swa": "hf", "phi3": "auto"}
# per-head parameters, cut by head with the attention's heads at tp 2 (`flow_heads`)
PER_HEAD = {"cohere": ("k_norm.weight", "q_norm.weight"), "granite_swa": ("sinks",)}




def _cohere_layer_norm(self, x):
    """CohereLayerNorm.forward in the input's dtype (HF's computes in float32)."""
    centered = x - x.mean(-1, keepdim=True)
    return self.weight * centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True)
                                                + self.variance_epsilon)


def _gemma3_rms_norm(self, x):
    """Gemma3RMSNorm.forward in the input's dtype (HF's computes in float32)."""
    return self._norm(x) * (1.0 + self.weight)


def _olmo2_rms_norm(self, x):
    """Olmo2RMSNorm.forward in the input's dtype (HF's computes in float32)."""
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                          + self.variance_epsilon))


# the norms that compute in float32 inside a float64 model: (module, class, a float64 forward)
FLOAT32_NORMS = {
    "olmo2": ("transformers.models.olmo2.modeling_olmo2", "Olmo2RMSNorm", _olmo2_rms_norm),
    "cohere": ("transformers.models.cohere.modeling_cohere", "CohereLayerNorm",
               _cohere_layer_norm),
    "gemma3_text": ("transformers.models.gemma3.modeling_gemma3", "Gemma3RMSNorm",
                    _gemma3_rms_norm),
}


@contextlib.contextmanager
def float64_norms(kind):
    """`kind`'s norm class computing in float64, in this process (restored after)."""
    module, name, forward = FLOAT32_NORMS[kind]
    cls = getattr(importlib.import_module(module), name)
    old = cls.forward
    cls.forward = forward
    try:
        yield
    finally:
        cls.forward = old


def _worker(kind, layout, balance, schedule, plan):
    if schedule == "export":
        return _export(kind, layout, balance, plan)
    if schedule == "float64 norms":
        with float64_norms(kind):
            return _worker(kind, layout, balance, "gpipe", plan)
    pp, tp = layout
    topo = hybridpar.init(pp=pp, tp=tp, timeout=60)
    return _train(kind, True, topo, balance, {"chunks": CHUNKS, "schedule": schedule,
                                              "tp_plan": plan})


@functools.cache
def _reference(kind):
    """The HF model on one device, the batch in the pipeline's micro-batches: losses, state
    (once per family: five layouts compare with it)."""
    return _hf_reference(kind, True, chunks=CHUNKS)


def _reference_float64_norms(kind):
    """`_reference` with `kind`'s norms computing in float64."""
    with float64_norms(kind):
        return _hf_reference(kind, True, chunks=CHUNKS)


def _export(kind, layout, folder, plan):
    """Export a pp x tp pipe of `kind` into `folder`; its logits on a few ids."""
    from hybridpar.hf import to_sequential
    from hybridpar.train.export import export_pipe

    topo = hybridpar.init(pp=layout[0], tp=layout[1], timeout=60)
    model = tiny(kind, seed=4)
    for m in model.modules():   # Gemma's sqrt(D), not a weight: exact, as from_pretrained's
        if hasattr(m, "scalar_embed_scale"):   # init leaves it (a float32 build cast to
            m.embed_scale.fill_(m.scalar_embed_scale)   # float64 keeps float32's value)
    pipe = hybridpar.HybridPipe(to_sequential(model), [2, 3], topology=topo, tp_plan=plan)
    export_pipe(pipe, f"{folder}/{kind}", config=model.config, max_shard_size="20KB")
    with torch.no_grad():
        return pipe(IDS)


IDS = torch.arange(12).reshape(2, 6) % 64


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    """The results of every case this session runs by name (tests/tiers.py holds some for the
    campaign): one spawn of 2 ranks, one of 4 (with the exports)."""
    folder = str(tmp_path_factory.mktemp("exports"))
    by_world: dict[int, dict] = {2: {}, 4: {}}
    for name in selected_ids(request, "test_a_family_trains_as_its_own_transformers_model"):
        args = CASES[name]
        by_world[args[1][0] * args[1][1]][name] = args
    for kind in selected_ids(request, "test_an_export_loads_with_from_pretrained_and_gives_"
                                      "the_pipes_logits"):
        by_world[4][f"export {kind}"] = (kind, (2, 2), folder, "export", EXPORTS[kind])
    for kind in selected_ids(request, "test_without_hfs_float32_norms_every_weight_agrees_"
                                      "to_1e_9_at_tp_2"):
        by_world[2][f"float64 norms {kind}"] = (kind, (1, 2), [5], "float64 norms", "auto")
    return {**{name: value for world, cases in by_world.items() if cases
               for name, value in spawn_cases(_worker, world, cases, timeout=280).items()},
            "folder": folder}


@pytest.mark.parametrize("kind", EXPORTS)
def test_an_export_loads_with_from_pretrained_and_gives_the_pipes_logits(kind, runs):
    import transformers

    folder = f"{runs['folder']}/{kind}"
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)
    with torch.no_grad():
        expected = model.eval()(IDS).logits
    assert type(model).__name__ == type(tiny(kind)).__name__
    for logits in runs[f"export {kind}"]:
        torch.testing.assert_close(logits, expected, atol=1e-12, rtol=0)


@pytest.mark.parametrize("name", list(CASES))
def test_a_family_trains_as_its_own_transformers_model(name, runs):
    kind, layout, _, _, plan = CASES[name]
    ref = _reference(kind)
    worst = max(float((runs[name][0]["state"][k] - v).abs().max()) for k, v in ref[1].items())
    if kind in ("gemma3_text", "cohere", "olmo2") and layout[1] > 1:   # module docstring
        split = {k: v for k, v in ref[1].items() if k.endswith(("q_norm.weight",
                                                                  "k_norm.weight"))}
        if kind == "olmo2":   # its norm's float32 sum of squares split over tp: every weight
            split = dict(ref[1]) if plan == "auto" else {}
        for r in runs[name]:
            for k, v in split.items():
                torch.testing.assert_close(r["state"][k], v, atol=1e-6 if kind == "olmo2"
                                           else 1e-8, rtol=0, msg=k)
                r["state"][k] = v
    for r in runs[name]:
        _assert_same(r, ref)      # every parameter and buffer, under its HF name
        if layout[1] > 1:         # the MLP is sharded in every family, by either plan
            mlp = [d for d in r["decisions"] if ".mlp." in d.split(" ")[0]]
            assert mlp and all(": column" in d or ": row" in d for d in mlp), mlp
        if kind == "olmo2" and layout[1] > 1 and plan == "auto":   # (its own plan gathers)
            normed = [d for d in r["decisions"] if "summed over tp" in d]
            assert [d.split(":")[0] for d in normed] == [
                f"{i}.self_attn.{n}_norm" for i in (1, 2) for n in "kq"], r["decisions"]
        if kind == "phi3" and layout[1] > 1 and plan == "auto":   # (its own plan gathers)
            qkv = [d for d in r["decisions"] if d.split(" ")[0].endswith(".qkv_proj")]
            assert len(qkv) == 2 and all(": column" in d and "fused in 3 parts (32, 16, 16)"
                                         in d for d in qkv), qkv
        if kind in PER_HEAD and layout[1] > 1:   # they hold this rank's heads
            heads = sorted(d.split(":")[0] for d in r["decisions"] if "sharded by head" in d)
            assert heads == [f"{i}.self_attn.{n}" for i in (1, 2) for n in PER_HEAD[kind]], \
                r["decisions"]
    print(f"{name}: max |diff| {worst:.1e}")


@pytest.mark.parametrize("kind", FLOAT32_NORMS)
def test_without_hfs_float32_norms_every_weight_agrees_to_1e_9_at_tp_2(kind, runs):
    """The differences above (q / k norm weights 1.4e-9, 1.9e-9; OLMo 2's distributed norm,
    2.0e-7) are Hugging Face's float32 arithmetic: with its norm class computing in float64, in
    the reference and in the ranks alike, every parameter agrees to 1e-9 at tp 2 ("auto")."""
    ref = _reference_float64_norms(kind)
    for r in runs[f"float64 norms {kind}"]:
        _assert_same(r, ref)
    worst = max(float((runs[f"float64 norms {kind}"][0]["state"][k] - v).abs().max())
                for k, v in ref[1].items())
    print(f"{kind} tp2, float64 norms: max |diff| {worst:.1e}")
