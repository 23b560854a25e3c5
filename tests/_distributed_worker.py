"""One process of the 2-process CPU run of tests/test_distributed.py (started by `accelerate launch`).

    accelerate launch --config_file training/accelerate_configs/cpu_2proc.yaml tests/_distributed_worker.py \
        OUT_DIR TRAINER_ARGS_JSON NO_TRAINER_ARGS_JSON

Trains with train.py (Seq2SeqTrainer) and then with train_no_trainer.py in the same two processes, and writes for
each rank: the parameters after each run (`OUT/{trainer,no_trainer}_params_<rank>.pt`) and, from the Trainer's own
prepared train DataLoader, the example indices of every batch this rank receives in epochs 0 and 1
(`OUT/sharding_<rank>.json`).
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
torch.set_num_threads(1)


def main() -> None:
    out = Path(sys.argv[1])
    trainer_args, no_trainer_args = json.loads(sys.argv[2]), json.loads(sys.argv[3])

    import vaswani_training.train as train
    from vaswani_training.train_no_trainer import run

    captured = {}
    original = train.PaperTrainer.get_train_dataloader

    def capture(self):
        captured["trainer"], captured["loader"] = self, original(self)
        return captured["loader"]

    train.PaperTrainer.get_train_dataloader = capture
    train.main(trainer_args)
    trainer, loader = captured["trainer"], captured["loader"]
    rank = trainer.args.process_index
    torch.save({k: v.detach().clone() for k, v in trainer.model.state_dict().items()},
               out / f"trainer_params_{rank}.pt")

    shard = loader.batch_sampler  # what the Trainer's accelerator made of our TokenBudgetBatchSampler
    sampler = shard.batch_sampler
    batches = {}
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        batches[epoch] = [[int(i) for i in batch] for batch in shard]
    (out / f"sharding_{rank}.json").write_text(json.dumps({
        "world_size": trainer.args.world_size,
        "shard_class": type(shard).__name__,
        "even_batches": shard.even_batches,
        "split_batches": shard.split_batches,
        "len_loader": len(loader),
        "batches": batches,
        "global_batches": {epoch: sampler.global_batches(epoch) for epoch in (0, 1)},
    }))

    metrics, model = run(no_trainer_args)
    assert metrics["world_size"] == 2, metrics
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out / f"no_trainer_params_{rank}.pt")


if __name__ == "__main__":
    main()
