"""The training configs, shipped in the package as qca_lowmem.configs: `--config NAME` loads NAME.yaml."""
