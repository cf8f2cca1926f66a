"""The demo model zipmoe-chat makes when no model is given: a tiny Qwen2-MoE (zipmoe-make-tiny's
checkpoint, real tokenizer) trained for a minute or two to answer a few questions about mixtures of
experts and ZipMoE, and one about each of ZipMoE's options, in the words of the option table.

It learns its answers by heart: a demo in recognisable language, not a language model. Only the
output rows of the tokens its answers use are trained (the head is zero elsewhere, so no other token
is ever the likeliest); everything else of the model trains as usual. Deterministic for a given
torch build: seeded, one thread, deterministic algorithms.
"""
from __future__ import annotations

import sys
from pathlib import Path

from ..errors import require_extra
from .tiny import make_tiny

DEMO_FORMAT = 1  # part of the demo file's name: bump when the recipe changes
STEPS = 400
BATCH = 8
LEARNING_RATE = 3e-3
SEED = 0

GREETING = "Hello! I am a tiny mixture of experts model, trained in a minute to show ZipMoE at work."
ANSWERS = [
    ("What is a mixture of experts?",
     "A mixture of experts is a model in which a small router sends every token to a few of many experts, so "
     "most of the weights sit idle at any moment."),
    ("What is ZipMoE?",
     "ZipMoE runs mixture of experts models on machines whose memory cannot hold them, without changing a single "
     "output bit."),
    ("How does ZipMoE work?",
     "ZipMoE keeps the experts on disk with their exponents compressed, and reads, decodes and caches the ones "
     "the router asks for while the model runs."),
    ("What is a GGUF?", "A GGUF is the file format of llama.cpp: the weights of a model and what is known of it."),
    ("How do I convert a model?", "Run zipmoe-convert on a Hugging Face folder or a GGUF, and give it the name of "
                                  "the ZipMoE GGUF to write."),
    ("Hello", GREETING),
    ("Hi", GREETING),
    ("Who are you?", "I am a tiny mixture of experts model, trained in a minute to show ZipMoE at work."),
    ("Thank you", "You are welcome. Give zipmoe-chat a real model to talk to one that knows more than I do."),
]


def demo_answers() -> list[tuple[str, str]]:
    """The questions and answers the demo learns: ANSWERS, then one per option of the option table."""
    from ..options import table

    pairs = list(ANSWERS)
    for o in table():
        name = o.name.replace("_", " ")
        pairs.append((f"What does the {name} option do?",
                      f"The {name} option sets the {o.help}. Its default is {o.default_text}."))
    return pairs


def _examples(tokenizer, pairs):
    """Each pair in the chat template zipmoe-chat renders (the default system prompt included), as a
    padded batch of token ids with its mask, and the token ids the answers use."""
    import torch

    ids = [tokenizer.apply_chat_template([{"role": "user", "content": q}, {"role": "assistant", "content": a}],
                                         tokenize=True) for q, a in pairs]
    longest = max(map(len, ids))
    tokens = torch.zeros((len(ids), longest), dtype=torch.long)
    mask = torch.zeros((len(ids), longest), dtype=torch.bool)
    for row, seq in enumerate(ids):
        tokens[row, :len(seq)] = torch.tensor(seq)
        mask[row, :len(seq)] = True
    used = sorted({t for seq in ids for t in seq})
    return tokens, mask, torch.tensor(used)


def _train(model, tokens, mask, used, progress: bool) -> float:
    import torch
    from tqdm import tqdm

    from .train_tiny import head_loss

    column = torch.full((int(used.max()) + 1,), -1, dtype=torch.long)
    column[used] = torch.arange(len(used))
    with torch.no_grad():
        model.lm_head.weight.zero_()  # never trained, never the likeliest
    opt = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.0)
    draw = torch.Generator().manual_seed(SEED)
    loss = float("nan")
    with tqdm(total=STEPS, desc="zipmoe-chat: training the demo model", unit="step", file=sys.stderr,
              disable=not progress, mininterval=1.0) as bar:
        for _ in range(STEPS):
            rows = torch.randint(0, len(tokens), (BATCH,), generator=draw)
            x, m = tokens[rows], mask[rows]
            hidden = model.model(input_ids=x, attention_mask=m.long()).last_hidden_state
            targets = m[:, 1:]
            step_loss = head_loss(hidden[:, :-1][targets], model.lm_head.weight[used], column[x[:, 1:][targets]])
            opt.zero_grad()
            step_loss.backward()
            opt.step()
            loss = step_loss.item()
            bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
            bar.update()
    return loss


def make_demo(out_dir: Path, progress: bool = True) -> Path:
    """Write the trained demo checkpoint (config, tokenizer, BF16 model.safetensors) into out_dir."""
    require_extra("convert", "the demo model")
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out_dir = Path(out_dir)
    make_tiny("qwen2moe", out_dir, seed=SEED)  # config and tokenizer; its random weights are replaced
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    tokens, mask, used = _examples(tokenizer, demo_answers())
    saved = (torch.get_num_threads(), torch.are_deterministic_algorithms_enabled())
    torch.set_num_threads(1)  # the model is tiny: one thread, and the same weights on every run
    torch.use_deterministic_algorithms(True)
    try:
        torch.manual_seed(SEED)
        config = AutoConfig.from_pretrained(out_dir)
        config.output_router_logits = False
        model = AutoModelForCausalLM.from_config(config).float()
        _train(model, tokens, mask, used, progress)
    finally:
        torch.set_num_threads(saved[0])
        torch.use_deterministic_algorithms(saved[1])
    state = {name: t.detach().to(torch.bfloat16).contiguous() for name, t in model.state_dict().items()}
    save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir
