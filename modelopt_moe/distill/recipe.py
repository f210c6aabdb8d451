"""The QAD recipe: the training settings of quantization-aware distillation, in one validated object.

Which parameters train, the learning rate and its schedule, Adam's settings, the loss (temperature, LM-loss mix) and
how weight amaxes follow the weights. ``QADRecipe()`` is the default that ``modelopt-moe qat --distill``, the demo and
the docs use; ``docs/qad.md`` has the measurements behind every value and the rules of thumb for the ones to tune.
Framework-free (the Megatron optimizer and scheduler built from it are in ``modelopt_moe.plugins.megatron``).
"""

from __future__ import annotations

import dataclasses
import math

__all__ = ["QADRecipe", "PARAM_GROUPS", "TEACHER_FP8_GRANULARITIES", "param_group"]

# What a Megatron GPT's parameters do, by name (see ``param_group``).
PARAM_GROUPS = ("experts", "dense", "router", "norms", "embedding", "output")
_DECAY_STYLES = ("cosine", "linear", "constant")
_AMAX_UPDATES = ("static", "dynamic", "learned")
TEACHER_FP8_GRANULARITIES = ("per_tensor", "per_channel")  # how a teacher stored in FP8 scales its weights
_INPUT_AMAX_UPDATES = ("static", "learned")


def param_group(name: str) -> str:
    """The group of a Megatron GPT parameter, from its name: ``experts`` (routed and shared experts, and their
    quantizers' learned amaxes), ``router``, ``norms`` (every layer norm, also TE's fused ``layer_norm_weight``),
    ``embedding``, ``output`` (the output layer) or ``dense`` (attention projections and any dense MLP)."""
    if ".experts." in name or ".shared_experts." in name:
        return "experts"
    if ".router." in name:
        return "router"
    if "norm" in name:
        return "norms"
    if name.startswith("embedding.") or ".embedding." in name:
        return "embedding"
    if "output_layer." in name:
        return "output"
    return "dense"


def _parse_train(spec: str) -> frozenset[str]:
    """``"experts"``, ``"experts+dense"``, ``"all"``, ``"all-router-norms"`` -> the set of groups that train."""
    spec = spec.replace(" ", "")
    if spec == "all" or spec.startswith("all-"):
        groups, removed = set(PARAM_GROUPS), spec.split("-")[1:]
        parts = removed
    else:
        groups, parts = set(), spec.split("+")
    for part in parts:
        if part not in PARAM_GROUPS:
            raise ValueError(f"QADRecipe.train={spec!r}: unknown parameter group {part!r}; expected 'all', "
                             f"'all-<group>-...' or '<group>+<group>...' with groups from {list(PARAM_GROUPS)}")
    if spec == "all" or spec.startswith("all-"):
        groups -= set(parts)
    else:
        groups |= set(parts)
    if not groups:
        raise ValueError(f"QADRecipe.train={spec!r}: no parameter group left to train")
    return frozenset(groups)


@dataclasses.dataclass(frozen=True)
class QADRecipe:
    """How to train a quantized student by distillation from its bf16 teacher (the defaults are measured, see
    ``docs/qad.md``).

    Attributes:
        lr: peak learning rate (Adam). Rule of thumb: about a tenth of the final learning rate of the teacher's own
            training and at most 1e-5 for billion-parameter models (Adam moves every trained parameter by about
            ``lr`` per step whatever its gradient, see ``docs/qad.md``).
        min_lr_ratio: learning rate at the end of the decay, as a fraction of ``lr``.
        warmup_fraction: share of the steps spent warming up linearly from 0 to ``lr``.
        lr_decay_style: ``cosine``, ``linear`` or ``constant`` after the warmup.
        train: which parameter groups train (:data:`PARAM_GROUPS`): ``"experts"``, ``"experts+dense"``, ``"all"``,
            ``"all-router-norms"`` (everything but those), ...; the others keep the teacher's values.
        adam_beta1, adam_beta2, adam_eps: Adam's settings.
        weight_decay: decoupled weight decay (AdamW); it pulls the weights away from the teacher's.
        clip_grad: gradient-norm clip.
        temperature: softmax temperature of the KL term.
        lm_loss_weight: weight of the language-modelling loss added to the KL (0: pure distillation).
        weight_amax_update: ``static``, ``dynamic`` or ``learned`` (the quantization config's top-level key of the
            same name; :meth:`quant_config` sets it).
        teacher_fp8: None (the default): the teacher keeps its weights as built. ``"per_tensor"`` or
            ``"per_channel"``: the teacher's weight matrices are stored as FP8 E4M3 codes and scales and dequantized
            per layer in its forward (about half the bytes of bf16; the teacher's logits move, see ``docs/qad.md``).
        input_amax_update: ``static`` or ``learned``: the input (activation) amaxes train, started from the
            calibrated values (the quantization config's key of the same name; :meth:`quant_config` sets ``learned``
            where the config does not set the key).
        amax_lr_mult: the learned amaxes' learning rate as a multiple of ``lr`` (its schedule too). Adam moves a
            parameter by about its learning rate per step, and an activation amax is hundreds of times a weight.

    Raises:
        ValueError: a value out of range, naming the field, the value and what is allowed.
    """

    lr: float = 3e-5
    min_lr_ratio: float = 0.1
    warmup_fraction: float = 0.05
    lr_decay_style: str = "cosine"
    train: str = "experts"
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    weight_decay: float = 0.0
    clip_grad: float = 1.0
    temperature: float = 1.0
    lm_loss_weight: float = 0.0
    weight_amax_update: str = "dynamic"
    teacher_fp8: str | None = None
    input_amax_update: str = "static"
    amax_lr_mult: float = 1.0

    def __post_init__(self):
        def need(ok: bool, field: str, expected: str):
            if not ok:
                raise ValueError(f"QADRecipe.{field}={getattr(self, field)!r}: expected {expected}")

        need(math.isfinite(self.lr) and self.lr > 0, "lr", "a positive number")
        need(0.0 <= self.min_lr_ratio <= 1.0, "min_lr_ratio", "a fraction in [0, 1]")
        need(0.0 <= self.warmup_fraction < 1.0, "warmup_fraction", "a fraction in [0, 1)")
        need(self.lr_decay_style in _DECAY_STYLES, "lr_decay_style", f"one of {list(_DECAY_STYLES)}")
        need(0.0 <= self.adam_beta1 < 1.0, "adam_beta1", "a number in [0, 1)")
        need(0.0 <= self.adam_beta2 < 1.0, "adam_beta2", "a number in [0, 1)")
        need(self.adam_eps > 0, "adam_eps", "a positive number")
        need(self.weight_decay >= 0, "weight_decay", "a number >= 0")
        need(self.clip_grad >= 0, "clip_grad", "a number >= 0 (0: no clipping)")
        need(self.temperature > 0, "temperature", "a positive number")
        need(self.lm_loss_weight >= 0, "lm_loss_weight", "a number >= 0")
        need(self.weight_amax_update in _AMAX_UPDATES, "weight_amax_update", f"one of {list(_AMAX_UPDATES)}")
        need(self.teacher_fp8 is None or self.teacher_fp8 in TEACHER_FP8_GRANULARITIES, "teacher_fp8",
             f"None or one of {list(TEACHER_FP8_GRANULARITIES)}")
        need(self.input_amax_update in _INPUT_AMAX_UPDATES, "input_amax_update",
             f"one of {list(_INPUT_AMAX_UPDATES)}")
        need(math.isfinite(self.amax_lr_mult) and self.amax_lr_mult > 0, "amax_lr_mult", "a positive number")
        _parse_train(self.train)

    @property
    def trained_groups(self) -> frozenset[str]:
        """The parameter groups that train (:data:`PARAM_GROUPS`)."""
        return _parse_train(self.train)

    def trains(self, name: str) -> bool:
        """Whether the parameter called ``name`` (a Megatron GPT parameter name) trains."""
        return param_group(name) in self.trained_groups

    def warmup_steps(self, steps: int) -> int:
        """Warmup steps out of ``steps`` (at least 1 when ``warmup_fraction`` > 0, and fewer than ``steps``)."""
        if self.warmup_fraction == 0 or steps <= 1:
            return 0
        return min(steps - 1, max(1, round(self.warmup_fraction * steps)))

    @property
    def min_lr(self) -> float:
        """The learning rate the schedule decays to: ``lr * min_lr_ratio``."""
        return self.lr * self.min_lr_ratio

    def quant_config(self, config):
        """A copy of the quantization config ``config`` (a dict, or a ``QuantizeConfig`` from ``mtq.load_config``)
        with this recipe's ``weight_amax_update``, and its ``input_amax_update: learned`` unless ``config`` sets its
        own (``static`` is every config's default)."""
        update = {"weight_amax_update": self.weight_amax_update}
        given = config if isinstance(config, dict) else config.model_fields_set
        if self.input_amax_update != "static" and "input_amax_update" not in given:
            update["input_amax_update"] = self.input_amax_update
        if isinstance(config, dict):
            return {**config, **update}
        return config.model_copy(update=update)

    def replace(self, **changes) -> QADRecipe:
        """A copy with ``changes`` (validated)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        """The recipe's fields as a plain dict (what a run records)."""
        return dataclasses.asdict(self)
