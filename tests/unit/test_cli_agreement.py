"""Greedy generations compared: lengths up to the end token, the end rate, the tokens agreed on with the teacher."""

import torch

from modelopt_moe.plugins.cli.agreement import generation_stats, held_out_prompts

END = 10


def test_generation_stats_count_up_to_the_first_end_token_and_compare_where_both_generated():
    teacher = torch.tensor([[1, 2, END, 4], [5, 6, 7, 8]])
    student = torch.tensor([[1, 3, 9, END], [5, 6, END, 0]])
    t, s = generation_stats(teacher, END, teacher), generation_stats(student, END, teacher)
    assert t == {"mean length": 3.5, "end rate": 0.5, "same tokens as the reference": 1.0}
    assert s["mean length"] == 3.5  # 4 (ends at the last token) and 3
    assert s["end rate"] == 1.0
    # positions both generated: 3 (of the first pair) + 3 (of the second); agreed: 1 + 2
    assert s["same tokens as the reference"] == 0.5
    assert generation_stats(student, END)["same tokens as the reference"] is None


def test_held_out_prompts_take_the_first_tokens_of_the_first_sequences():
    batches = [{"tokens": torch.arange(12).reshape(2, 6)}, {"tokens": 100 + torch.arange(12).reshape(2, 6)}]
    assert held_out_prompts(batches, 3, 2).tolist() == [[0, 1], [6, 7], [100, 101]]
