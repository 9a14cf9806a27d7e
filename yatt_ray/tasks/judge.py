"""The embedded default judge: a tiny model taught to say whether a response matches the reference answer.

The GenRM demo needs a judge whose verdict carries the signal, built locally like the policy. It is the
tiny Llama with 4 layers instead of 2 (two layers did not learn to compare two numbers), given
`demo.judge_sft_steps` supervised steps of 32 examples on the demo judge template (`DEMO_TEMPLATE`) with
balanced examples: the right answer, near misses (off by a few), other numbers and junk, each labelled "Y"
(correct) or "N" (wrong). Users point `reward.genrm.path` at a real judge instead.

The same examples in 800 steps of 32 cost what 400 steps of 64 did (~30 s on 2 cores) and make a judge that the
policy's near misses do not fool: wrongly said "Y" to 0-1% of answers off by 1-3, against 3-8% after 400 steps
of 64 (two seeds, an AMD EPYC VM). A judge that says "Y" to 8% of near misses rewards a policy that makes them,
and the GenRM run then learns the task slower than the rule does, by how much depending on the CPU's rounding.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from yatt_ray.models.tiny import TinyModelSpec, build_tiny_model, sft_tensors

DEMO_TEMPLATE = "{response}|{ground_truth}?"  # e.g. "19|19?" -> "Y"; the prompt is not needed here
YES, NO = "Y", "N"


def judge_examples(count: int, seed: int, max_operand: int) -> list[tuple[str, str]]:
    """(judge prompt, verdict) pairs, half correct; wrong answers are near misses, other sums or junk."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        truth = str(a + b)
        if rng.random() < 0.5:
            response = truth
        else:
            kind = rng.random()
            if kind < 0.5:
                response = str(max(0, a + b + rng.choice([-3, -2, -1, 1, 2, 3, 10, -10])))
            elif kind < 0.8:
                response = str(rng.randint(0, 2 * max_operand))
            else:
                response = "".join(rng.choice("0123456789+= ") for _ in range(rng.randint(0, 4)))
            if response == truth:
                response = truth + "1"
        verdict = YES if response == truth else NO
        out.append((DEMO_TEMPLATE.format(prompt=f"{a}+{b}=", response=response, ground_truth=truth), verdict))
    return out


def build_demo_judge(out_dir: Path, sft_steps: int, max_operand: int, batch: int = 32) -> Path:
    """Random tiny Llama -> `sft_steps` AdamW steps on verdict tokens -> a Hugging Face directory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = out_dir.with_name(out_dir.name + ".tmp")
    build_tiny_model(tmp, TinyModelSpec(num_layers=4, seed=1))
    tokenizer = AutoTokenizer.from_pretrained(tmp)
    model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)
    examples = judge_examples(sft_steps * batch, seed=2, max_operand=max_operand)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-3, total_steps=sft_steps)
    torch.manual_seed(1)
    model.train()
    for step in range(sft_steps):
        input_ids, labels = sft_tensors(tokenizer, examples[step * batch : (step + 1) * batch])
        loss = model(input_ids=input_ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        schedule.step()
    model.save_pretrained(tmp)
    tmp.rename(out_dir)  # atomic: a half-built judge is never reused
    return out_dir
