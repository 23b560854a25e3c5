"""The machinery the training commands share (the commands are the modules of `vaswani_training` itself, one file each):
the flags and presets, the precision and the long-run dropout, the step planner, the run's scaffold and its state,
checkpoints, averaging and the choice on validation, the output folder, the data and model preparation, the test
set's scoring, publishing and the Space files. Nothing here imports a command.
"""
