"""A rank that fails on the GPU as users' jobs do, for bench/gpu/core.py's diagnosis checks:
`torchrun ... -m bench.gpu.fail_case oom|assert`. Under @record, as the runtime's entry point,
so the error file is what the agent would read."""
import sys

import torch
from torch.distributed.elastic.multiprocessing.errors import record


@record
def main(case: str) -> None:
    torch.cuda.set_device(0)
    if case == "oom":
        free, _total = torch.cuda.mem_get_info()
        keep = [torch.empty(int(free * 0.6), dtype=torch.uint8, device="cuda")]
        keep.append(torch.empty(int(free * 0.6), dtype=torch.uint8, device="cuda"))  # CUDA OOM
    elif case == "assert":
        emb = torch.nn.Embedding(256, 16).cuda()
        ids = torch.tensor([3, 999], device="cuda")  # a token id past the vocabulary
        emb(ids).sum().item()  # the device-side assert surfaces at this sync
    else:
        raise SystemExit(f"unknown case {case!r}: oom or assert")


if __name__ == "__main__":
    main(sys.argv[1])
