"""HF `config.json` <-> ModelConfig, one module per model family; `kdaserve.model.registry`
picks the module by `model_type`. Torch-free: the server checks a config before it starts the
engine process."""
