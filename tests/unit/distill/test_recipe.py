"""QADRecipe: the default QAD settings, validated where they are built; which Megatron parameters each group holds."""

import dataclasses
import re

import pytest

import modelopt_moe.quantization as mtq
from modelopt_moe.distill import PARAM_GROUPS, QADRecipe, param_group

NAMES = {
    "embedding.word_embeddings.weight": "embedding",
    "decoder.layers.0.input_layernorm.weight": "norms",
    "decoder.layers.0.self_attention.linear_qkv.weight": "dense",
    "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight": "norms",  # TE's fused norm
    "decoder.layers.0.self_attention.q_layernorm.weight": "norms",
    "decoder.layers.0.self_attention.linear_proj.weight": "dense",
    "decoder.layers.0.pre_mlp_layernorm.weight": "norms",
    "decoder.layers.0.mlp.router.weight": "router",
    "decoder.layers.0.mlp.router.expert_bias": "router",
    "decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight": "experts",
    "decoder.layers.0.mlp.experts.linear_fc2.weight7": "experts",
    "decoder.layers.0.mlp.experts.linear_fc1.weight_quantizer._amax": "experts",
    "decoder.layers.0.mlp.shared_experts.linear_fc1.weight": "experts",
    "decoder.layers.1.mlp.linear_fc1.weight": "dense",  # a dense (non-MoE) layer
    "decoder.final_layernorm.weight": "norms",
    "output_layer.weight": "output",
}


@pytest.mark.parametrize(("name", "group"), NAMES.items())
def test_param_group_of_megatron_names(name, group):
    assert param_group(name) == group


def test_default_trains_the_expert_weights_only():
    recipe = QADRecipe()
    assert recipe.trained_groups == {"experts"}
    assert [n for n in NAMES if recipe.trains(n)] == [n for n, g in NAMES.items() if g == "experts"]


@pytest.mark.parametrize(("spec", "groups"), [
    ("all", set(PARAM_GROUPS)),
    ("all-router-norms", set(PARAM_GROUPS) - {"router", "norms"}),
    ("experts+dense", {"experts", "dense"}),
    (" experts + norms ", {"experts", "norms"}),
])
def test_train_spec(spec, groups):
    assert QADRecipe(train=spec).trained_groups == groups


@pytest.mark.parametrize(("changes", "message"), [
    ({"lr": 0.0}, "QADRecipe.lr=0.0: expected a positive number"),
    ({"lr": float("nan")}, "QADRecipe.lr=nan"),
    ({"warmup_fraction": 1.0}, "QADRecipe.warmup_fraction=1.0: expected a fraction in [0, 1)"),
    ({"lr_decay_style": "cosin"}, "QADRecipe.lr_decay_style='cosin': expected one of ['cosine', 'linear', 'constant']"),
    ({"adam_beta2": 1.0}, "QADRecipe.adam_beta2=1.0"),
    ({"temperature": 0}, "QADRecipe.temperature=0"),
    ({"lm_loss_weight": -1}, "QADRecipe.lm_loss_weight=-1"),
    ({"weight_amax_update": "learnt"}, "QADRecipe.weight_amax_update='learnt': expected one of ['static', 'dynamic'"),
    ({"train": "experts+routers"}, "unknown parameter group 'routers'"),
    ({"train": "all-experts-dense-router-norms-embedding-output"}, "no parameter group left to train"),
])
def test_bad_values_are_refused_naming_the_field(changes, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        QADRecipe(**changes)
    with pytest.raises(ValueError, match=re.escape(message)):  # replace() validates too
        QADRecipe().replace(**changes)


def test_warmup_steps_and_helpers():
    recipe = QADRecipe(warmup_fraction=0.05, lr=2e-5, min_lr_ratio=0.1)
    assert recipe.warmup_steps(200) == 10
    assert recipe.warmup_steps(10) == 1
    assert recipe.warmup_steps(1) == 0
    assert QADRecipe(warmup_fraction=0.0).warmup_steps(200) == 0
    assert recipe.min_lr == pytest.approx(2e-6)
    assert recipe.quant_config({"algorithm": "max"}) == {"algorithm": "max",
                                                         "weight_amax_update": recipe.weight_amax_update}
    loaded = recipe.replace(weight_amax_update="learned").quant_config(mtq.load_config("nvfp4_experts.yaml"))
    assert loaded.weight_amax_update == "learned"
    assert loaded.algorithm == "max"
    assert recipe.to_dict() == dataclasses.asdict(recipe)
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.lr = 1.0


def test_learned_input_amaxes_in_the_recipe():
    with pytest.raises(ValueError, match=re.escape("QADRecipe.input_amax_update='dynamic': expected one of "
                                                   "['static', 'learned']")):
        QADRecipe(input_amax_update="dynamic")
    with pytest.raises(ValueError, match=re.escape("QADRecipe.amax_lr_mult=0.0: expected a positive number")):
        QADRecipe(amax_lr_mult=0.0)
    recipe = QADRecipe(input_amax_update="learned", amax_lr_mult=100.0)
    assert recipe.quant_config({"algorithm": "max"})["input_amax_update"] == "learned"
    # a config that says its own keeps it (a YAML's input_amax_update: static)
    assert recipe.quant_config({"input_amax_update": "static"})["input_amax_update"] == "static"
    loaded = recipe.quant_config(mtq.load_config("nvfp4_experts.yaml"))
    assert loaded.input_amax_update == "learned"
    assert QADRecipe().quant_config(loaded).input_amax_update == "learned"  # the recipe's default changes nothing
