"""What a run is: the TOML config (`sections`: its dataclasses; `keys`: a value's type,
choices and range; `config`: `load_config`), its checks across fields and against the model
(`config_check`), a user's builder function checked before any worker starts
(`builder_check`), the command-line options of a run (`options`), and the model a config
builds on each rank (`model_build`). Imports what a config names (models, `hf`, data,
balance, optimizers, tp plan styles, checkpoint modes, schedules); nothing of the trainer.
"""
