"""One of two gloo processes of tests/test_distributed.py::test_a_stop_in_one_process_stops_all_at_the_same_step:
rank 0 alone is interrupted (a signal) at step 2 and rank 1 alone passes its deadline at step 4; each step both ask
`TimeLimit.on_step_end` whether to stop. Prints the step each rank stopped at."""

import sys

import torch
from transformers import TrainerControl, TrainerState, TrainingArguments

from vaswani_training.train import TimeLimit

rank, port = int(sys.argv[1]), sys.argv[2]
torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
args = TrainingArguments(output_dir="unused", use_cpu=True, report_to=[])
limit, stopped = TimeLimit(None), []
for first_stop in ("signal", "deadline"):
    limit.interrupted, limit.deadline = False, None
    for step in range(1, 7):
        if first_stop == "signal" and rank == 0 and step == 2:
            limit.interrupted = True
        if first_stop == "deadline" and rank == 1 and step == 4:
            limit.deadline = 1.0  # long past (monotonic seconds)
        control = limit.on_step_end(args, TrainerState(global_step=step, max_steps=100), TrainerControl())
        if control.should_training_stop:
            stopped.append(step)
            break
print("stopped", *stopped)
torch.distributed.destroy_process_group()
