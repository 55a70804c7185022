import torch
from transformers import LlamaConfig, LlamaForCausalLM

import hybridpar
from hybridpar.hf import to_sequential
from hybridpar.nn import CausalLMLoss


def train(steps=30):
    topo = hybridpar.init(pp=2, tp=2)                 # 4 ranks: 2 stages x 2 tensor shards
    torch.manual_seed(0)                              # the same model on every rank
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=176,
                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)
    model = to_sequential(LlamaForCausalLM(config))   # embedding, 4 blocks, norm, head
    pipe = hybridpar.HybridPipe(model, [4, 3], chunks=4, topology=topo, schedule="1f1b",
                                tp_plan="auto", loss_fn=CausalLMLoss())
    opt = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    for step in range(steps):
        start = torch.randint(0, 256, (8, 1), generator=torch.Generator().manual_seed(step))
        ids = (start + torch.arange(32)) % 256        # counting: each token is the last + 1
        opt.zero_grad()
        loss = pipe.train_step(ids, ids)              # labels = input ids, as in HF
        opt.step()
        if topo.rank == 0 and step % 5 == 4:
            print(f"step {step + 1}: loss {loss.item():.3f}")


if __name__ == "__main__":
    hybridpar.spawn(train, 4)                         # or: torchrun --nproc-per-node 4 ...
