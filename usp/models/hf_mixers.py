"""Which modules of an HF model mix tokens, and whether usp computes them under SP.

Under sequence parallelism a rank holds ``S/P`` tokens. USP attention (the function the
plug-in registers) sees the whole sequence; every other module sees only the rank's shard.
A model is exact under SP only if everything outside the attention call is token-local
(the output at a token depends on that token alone). A Mamba/SSM mixer, a linear-
attention recurrence (Gated DeltaNet, lightning attention) or a short convolution over the
sequence breaks that, and would run without an error and give wrong results.

The rule, which does not depend on remembering architectures: every module inside the
decoder (:func:`decoder_of`: ``model.get_decoder()``, or the transformers model inside a
causal LM whose ``get_decoder()`` is itself, as Llama 4's) must be one of

- known token-local building blocks: ``nn.Linear`` (and transformers' ``Conv1D``, a
  linear layer), ``nn.Embedding``, ``nn.Dropout``, ``nn.Identity``, ``nn.LayerNorm``,
  activations (``torch.nn`` and ``transformers.activations``), and classes whose names
  end in a token-local role (:data:`TOKEN_LOCAL_SUFFIXES`: norms, MLPs and FFNs, MoE
  blocks, experts, routers and gates, rotary embeddings) — their children are checked too;
- an attention module whose ``forward`` calls attention through transformers'
  ``ALL_ATTENTION_FUNCTIONS`` (the call usp computes);
- the decoder itself and its layers (:func:`layer_stack`: the members of its module
  lists that are layers; their own code only adds and routes what their children
  return), also decoder layers nested in a layer (class names ending in
  ``DecoderLayer``: Zamba2's hybrid layer holds a Mamba and a shared attention decoder
  layer), and containers (``nn.Sequential`` chains its children, which are checked).
  Any other member of a list (XLM's ``attentions``, ``ffns``) is inspected;
- a token mixer usp computes exactly under SP itself (:data:`USP_MIXERS`: usp's Gated
  DeltaNet, Mamba-2, Mamba-1, KDA and the short conv, which :func:`swap_linear_attention`
  puts in place of transformers' layers, :mod:`usp.models.hf_swap`); a layer kind
  (``linear_attention``) is accepted where such a module computes it.

A convolution or recurrent module (``nn.Conv1d``, ``nn.RNN``, ...) mixes tokens; any other
module is *unknown* and refused, not trusted: attention written in a model's own code
(outside transformers' interface) is refused so. Absolute position embeddings are refused
where the decoder's ``forward`` takes no ``position_ids`` (:func:`position_mixers`: it
numbers each shard from 0). The config's per-layer kinds (``layer_types``,
``layers_block_type``, ``block_types``) that are not attention are refused too. In one
process (SP degree 1) nothing is refused: there is no shard.
"""

from __future__ import annotations

import copy
import functools
import inspect
import weakref

import torch
from torch import nn

from usp.compile_marks import constant_result
from usp.errors import ModelConfigError
from usp.models.hf_multimodal_checks import is_encoder_config
from usp.models.hf_structure import Mixer, decoder_of, layer_stack, position_mixers
from usp.models.hf_swap import USP_MIXERS, swap_linear_attention  # noqa: F401 (its old home)

#: class-name endings of modules that act on each token alone (their children are checked)
TOKEN_LOCAL_SUFFIXES = (
    "Norm", "NormGated", "MLP", "Mlp", "GLU", "FeedForward", "FFN", "Experts", "Expert", "MoE", "Moe",
    "MoeBlock", "MoEBlock", "SparseMoeBlock", "MoELayer", "MoA", "MoeStatics", "Router",
    "TopKRouter", "Gate", "Gating", "RotaryEmbedding",
)  # fmt: skip
#: leaf modules that act on each token alone
TOKEN_LOCAL_TYPES = (nn.Linear, nn.Embedding, nn.Dropout, nn.Identity, nn.LayerNorm)
#: modules that combine neighbouring tokens along the sequence
SEQUENCE_MIXING_TYPES = (nn.modules.conv._ConvNd, nn.RNNBase, nn.modules.padding._ConstantPadNd)
#: per-layer kinds (``config.layer_types`` and kin) that are attention usp computes
ATTENTION_LAYER_KINDS = ("full_attention", "sliding_attention", "chunked_attention", "attention")
#: per-layer kinds that act on each token alone (Nemotron-H's MLP and MoE layers)
TOKEN_LOCAL_LAYER_KINDS = ("mlp", "moe")
_COMPUTED_LAYER_KINDS = ATTENTION_LAYER_KINDS + TOKEN_LOCAL_LAYER_KINDS
LAYER_KIND_FIELDS = ("layer_types", "layers_block_type", "block_types")
_ACTIVATION_MODULES = ("torch.nn.modules.activation", "transformers.activations")


class TokenMixerError(ModelConfigError):
    """An HF model mixes tokens outside the attention call USP computes, under SP."""


def sequence_mixers(model: nn.Module) -> list[Mixer]:
    """The modules of ``model``'s decoder that are not token-local and not the attention
    usp computes (outermost first; a flagged module's children are not listed), its
    absolute position embeddings that the global positions cannot reach, then the
    config's non-attention layer kinds. Empty when the model is exact under SP."""
    decoder = decoder_of(model)
    structural = {id(decoder)} | {id(layer) for layer in layer_stack(decoder)}
    found: list[Mixer] = []
    flagged: list[str] = []  # flagged or computed by usp: their children are not listed
    computed_layers: set[int] = set()  # layer indices whose mixer usp computes
    for path, module in decoder.named_modules():
        if any(path.startswith(prefix + ".") for prefix in flagged):
            continue
        nested_layer = type(module).__name__.endswith("DecoderLayer")  # e.g. Zamba2's
        if (
            id(module) in structural
            or nested_layer
            or isinstance(module, (nn.ModuleList, nn.ModuleDict, nn.Sequential))
        ):
            continue
        if isinstance(module, USP_MIXERS):
            flagged.append(path)
            parts = path.split(".")
            if len(parts) >= 2 and parts[1].isdigit():
                computed_layers.add(int(parts[1]))
            continue
        why = _why_mixing(module)
        if why is not None:
            found.append(Mixer(path, type(module).__name__, why))
            flagged.append(path)
    found.extend(position_mixers(decoder, skip=flagged))
    kinds = _layer_kind_mixers(getattr(model, "config", None))
    found.extend(m for m in kinds if int(m.path.split(".")[1]) not in computed_layers)
    return found


def _why_mixing(module: nn.Module) -> str | None:
    """None for a module usp knows to be token-local (or USP attention); else why not."""
    if isinstance(module, SEQUENCE_MIXING_TYPES):
        return f"{type(module).__name__} combines neighbouring tokens of the sequence"
    if isinstance(module, TOKEN_LOCAL_TYPES) or _is_linear_alias(module):
        return None
    cls = type(module)
    if cls.__module__.startswith(_ACTIVATION_MODULES) or _calls_attention_interface(cls):
        return None
    if cls.__name__.endswith(TOKEN_LOCAL_SUFFIXES):
        return None
    inner = [type(m).__name__ for m in module.modules() if isinstance(m, SEQUENCE_MIXING_TYPES)]
    if inner:
        return f"it runs {', '.join(sorted(set(inner)))} along the sequence"
    return "usp does not know it to be token-local and it is not the attention usp computes"


def _is_linear_alias(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2 style) is a linear layer with transposed weight."""
    cls = type(module)
    return cls.__name__ == "Conv1D" and cls.__module__ == "transformers.pytorch_utils"


@functools.cache
def _calls_attention_interface(cls: type) -> bool:
    """Whether ``cls.forward`` hands attention to transformers' attention interface (so
    that attn_implementation=usp computes it)."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):  # no source (compiled, built in): not known
        return False
    return "ALL_ATTENTION_FUNCTIONS" in source


def _layer_kind_mixers(config) -> list[Mixer]:
    found = []
    for field in LAYER_KIND_FIELDS:
        kinds = getattr(config, field, None)
        if not isinstance(kinds, (list, tuple)):
            continue
        for index, kind in enumerate(kinds):
            if isinstance(kind, str) and kind not in _COMPUTED_LAYER_KINDS:
                found.append(Mixer(f"layers.{index}", f"{field}={kind!r}", "a layer kind"))
    return found


def mixer_message(model: nn.Module, mixers: list[Mixer], grid: str) -> str:
    """One message naming the model type, the layers and modules concerned, and the fix."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None) or "?"
    modules = _group_by_layer(mixers)
    return (
        f"{type(model).__name__} (model_type {model_type!r}) mixes tokens outside the "
        f"attention usp computes: {modules}. Under sequence parallelism ({grid}) each rank "
        "would run those modules on its shard of the sequence only, and the results would be "
        "silently wrong. Run it with one SP rank (ulysses = ring = 1; data parallelism is "
        "fine), train a model family usp computes (usp.models.FAMILIES), or, for Gated "
        "DeltaNet (Qwen3.5, Qwen3-Next), Mamba-2 (Bamba, Granite 4 hybrid, Nemotron-H, "
        "Falcon-H1, Zamba2), Mamba-1 (Jamba), Kimi Delta Attention (Kimi-Linear) and "
        "short-conv layers "
        "(LFM2, LFM2-MoE, LFM3), let usp compute them: "
        "usp.models.hf.swap_linear_attention(model, plan), then register(plan, model=model)"
    )


def _group_by_layer(mixers: list[Mixer]) -> str:
    """'layers 0, 1, 2: linear_attn (Qwen3_5GatedDeltaNet: ...)', one part per module
    kind, the layers it appears in gathered."""
    groups: dict[tuple[str, str, str], list[str]] = {}
    for mixer in mixers:
        parts = mixer.path.split(".")
        if len(parts) >= 2 and parts[1].isdigit():  # <stack>.<index>.<rest>
            key, where = (parts[0], ".".join(parts[2:]), f"{mixer.cls}: {mixer.why}"), parts[1]
        else:
            key, where = ("", mixer.path, f"{mixer.cls}: {mixer.why}"), ""
        groups.setdefault(key, []).append(where)
    shown = []
    for (stack, rest, what), indices in groups.items():
        if stack:
            target = f" {rest}" if rest else ""
            shown.append(f"{stack} {', '.join(indices)}:{target} ({what})")
        else:
            shown.append(f"{rest} ({what})")
    return "; ".join(shown)


def grid_of(plan) -> str:
    return f"ulysses {plan.ulysses_degree} x ring {plan.ring_degree}"


def mixer_problem(model: nn.Module, plan) -> str | None:
    """The refusal message for ``model`` under ``plan``, or None (exact, or one SP rank)."""
    if plan.sp_degree == 1:
        return None
    mixers = sequence_mixers(model)
    return mixer_message(model, mixers, grid_of(plan)) if mixers else None


def check_model(model: nn.Module, plan) -> None:
    """Refuse (:class:`TokenMixerError`) an HF model that mixes tokens outside USP attention
    when ``plan`` has more than one SP rank. Deterministic from the model, so every rank
    raises the same error, before any collective."""
    problem = mixer_problem(model, plan)
    if problem is not None:
        raise TokenMixerError(problem)


class MixerCheck:
    """The plug-in's check of the model behind an attention call, once per model config.

    The attention function and the mask function see the model's ``config``, not the
    model: the check builds the model's structure from the config on the meta device (no
    memory, no weights) and inspects it (:func:`sequence_mixers`). The verdict is kept per
    config object, so the later calls of a forward cost a dictionary look-up."""

    def __init__(self, plan):
        self.plan = plan
        self._verdicts: dict[int, tuple[object, str | None]] = {}
        #: config id -> (config, the model built on it): inspected in place of a meta build
        self._built: dict[int, tuple[object, weakref.ref]] = {}
        self._watched: weakref.WeakSet = weakref.WeakSet()
        #: config id -> (config, whether its model's last forward asked for a KV cache)
        self._cache_requested: dict[int, tuple[object, bool]] = {}

    def watch(self, model: nn.Module) -> None:
        """A transformers model built with this check's attention name
        (:mod:`usp.models.hf_watch`) or given to ``register``: under SP it is inspected
        itself at its first call (a forward pre-hook, before anything computes: also for a
        model that never calls attention), and its config's verdict comes from it rather
        than from a meta build (the outermost model of a config is built last and is the
        one inspected). The hook also notes whether the forward asks for a KV cache
        (``use_cache``, else the config's), which the attention call refuses under SP."""
        if self.plan.sp_degree == 1 or is_encoder_config(model.config):
            return  # a vision/audio tower: a local encoder (usp.models.hf_multimodal_checks)
        self._built[id(model.config)] = (model.config, weakref.ref(model))
        if model not in self._watched:
            self._watched.add(model)

            def before_forward(model, args, kwargs, check=self):
                # a function, not a bound method: copy.deepcopy(model) (TRL's reference
                # models) shares it instead of copying the check and its plan's groups
                check._before_forward(model, args, kwargs)

            model.register_forward_pre_hook(before_forward, with_kwargs=True)

    def _before_forward(self, model: nn.Module, args, kwargs) -> None:
        self(model.config)
        if torch.compiler.is_compiling():  # a compiled forward: use_cache reaches attention
            return
        use_cache = kwargs.get("use_cache")
        if use_cache is None:
            use_cache = getattr(model.config, "use_cache", False)
        self._cache_requested[id(model.config)] = (model.config, bool(use_cache))

    def cache_requested(self, config) -> bool:
        """Whether the last forward of the watched model of ``config`` asked for a KV
        cache (eager forwards; the attention function refuses it under SP)."""
        if torch.compiler.is_compiling():
            return False
        known = self._cache_requested.get(id(config))
        return known is not None and known[0] is config and known[1]

    def accept(self, model: nn.Module) -> None:
        """Check ``model`` itself (raising as :func:`check_model`) and keep the verdict
        for its config and every sub-config its modules carry (a vision-language model's
        attention calls carry its text config): its calls then need no meta build."""
        problem = mixer_problem(model, self.plan)
        configs = [model.config] + [getattr(m, "config", None) for m in model.modules()]
        for config in configs:
            if config is not None:
                self._verdicts[id(config)] = (config, problem)
        if problem is not None:
            raise TokenMixerError(problem)
        self.watch(model)

    def problem(self, config) -> str | None:
        if self.plan.sp_degree == 1 or config is None or is_encoder_config(config):
            return None  # an encoder's calls: over its own patches (hf_multimodal_checks)
        known = self._verdicts.get(id(config))
        if known is not None and known[0] is config:
            return known[1]
        built = self._built.get(id(config))
        model = built[1]() if built is not None and built[0] is config else None
        verdict = (
            _problem_of_config(config, self.plan)
            if model is None
            else mixer_problem(model, self.plan)
        )
        self._verdicts[id(config)] = (config, verdict)  # holds config: its id stays its own
        return verdict

    def __call__(self, config) -> None:
        compiling = torch.compiler.is_compiling()
        problem = _traced_problem(self, config) if compiling else self.problem(config)
        if problem is not None:
            raise TokenMixerError(problem)


@constant_result
def _traced_problem(check: MixerCheck, config) -> str | None:
    """The verdict, computed eagerly while a compiled graph is traced (a constant of it)."""
    return check.problem(config)


def _problem_of_config(config, plan) -> str | None:
    model = _meta_model(config)
    if model is None:
        return (
            f"usp cannot inspect the model of config {type(config).__name__} "
            f"(model_type {getattr(config, 'model_type', None)!r}: no transformers causal-LM "
            "class builds it) to see whether it mixes tokens outside attention; call "
            "usp.models.hf.check_model(model, plan) on the built model before its first "
            "forward"
        )
    return mixer_problem(model, plan)


def _meta_model(config) -> nn.Module | None:
    """The transformers model of ``config``, built on the meta device (no memory) with
    transformers' default attention (the modules are the same: the plug-in's check reads
    their classes, not what they call; a model that picks attention classes from a table
    of its own has no usp entry in it)."""
    from transformers import AutoModel, AutoModelForCausalLM

    for auto in (AutoModelForCausalLM, AutoModel):
        try:
            auto_class = auto._model_mapping[type(config)]
        except KeyError:
            continue
        config = copy.deepcopy(config)
        config._attn_implementation = None  # transformers' own: structure, not usp's name
        with torch.device("meta"):
            return auto_class._from_config(config)
    return None
