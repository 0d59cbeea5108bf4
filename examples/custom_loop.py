"""A custom PyTorch training step with `ftis_loss`, on completions another model generated.

Run: python examples/custom_loop.py  (CPU, a few seconds; no download: the models are built from configs)
"""  # noqa: E501

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from ftis_kernels import ftis_loss

V, G, P, T = 64, 8, 5, 12  # vocabulary, group size, prompt and completion lengths
config = Qwen2Config(
    vocab_size=V,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    eos_token_id=None,
    pad_token_id=0,
)
torch.manual_seed(0)
peer = Qwen2ForCausalLM(config).eval()  # the node that generated the group (pi_gen)
policy = Qwen2ForCausalLM(config)  # the node that trains (pi_theta)
optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)

# What the peer sends for one prompt: completion token ids, their logprobs under the peer, rewards.
prompt = torch.randint(1, V, (1, P)).expand(G, P)
with torch.no_grad():
    out = peer.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        do_sample=True,
        max_new_tokens=T,
        min_new_tokens=T,
        output_scores=True,
        return_dict_in_generate=True,
    )
completion = out.sequences[:, P:]
gen_logprobs = peer.compute_transition_scores(out.sequences, out.scores, normalize_logits=True)
rewards = (
    (completion % 2 == 0).float().mean(dim=1)
)  # any per-sample reward; here: share of even ids
advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-4)  # group-relative (GRPO)

for step in range(5):
    logits = policy(torch.cat([prompt, completion], dim=1)).logits[
        :, P - 1 : -1
    ]  # scores completion
    loss, metrics = ftis_loss(
        logits,
        completion,
        gen_logprobs,
        advantages,
        is_mode="tis",
        is_cap=2.0,
        filter="negative_offpolicy",
        kl_threshold=50.0,
    )
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(
        f"step {step}: loss {loss.item():+.4f}  kl {metrics['kl_mean'].item():.2f}  "
        f"filtered {metrics['filtered_frac'].item():.2f}  w {metrics['is_weight_mean'].item():.3f}  "  # noqa: E501
        f"truncated {metrics['is_truncated_frac'].item():.2f}"
    )
