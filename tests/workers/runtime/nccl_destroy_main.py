"""Test-only entry point: workers.runtime's `main` (with its @record) in a process whose
destroy_process_group behaves as NCCL's does while a peer waits in a collective: it never
returns. gloo's returns at once, which hid a rank that destroyed after an error (it hung on
NCCL with no error file). A fake at the library boundary only; run as
`torchrun ... -m tests.workers.runtime.nccl_destroy_main --config C`."""
import time

import torch.distributed as dist

from workers.runtime.__main__ import main


def destroy_blocking_like_nccl(group=None) -> None:
    print(f"rank {dist.get_rank()} destroy_process_group: blocking (NCCL, a peer in a collective)",
          flush=True)
    while True:  # only a kill ends it, as with a real communicator waiting on its peers
        time.sleep(3600)


if __name__ == "__main__":
    dist.destroy_process_group = destroy_blocking_like_nccl
    main()
