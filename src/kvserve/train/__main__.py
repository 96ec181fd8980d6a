"""`python -m kvserve.train <stage> ...`, which is also what torchrun launches:

    torchrun --nproc_per_node 2 -m kvserve.train pretrain --tokenizer runs/tok --out runs/base

Each process reads RANK / WORLD_SIZE / MASTER_ADDR from the environment torchrun sets and joins
the process group (gloo on CPU, nccl on CUDA); rank 0 writes the outputs.
"""

from kvserve.train.cli import train_app


def main() -> None:
    import torch.distributed as dist

    try:
        train_app(prog_name="python -m kvserve.train")
    finally:
        if dist.is_initialized():
            # Leave together: a rank that tore down gloo while rank 0 was still writing its outputs
            # died in about one run in four with "terminate called without an active exception".
            dist.barrier()
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
