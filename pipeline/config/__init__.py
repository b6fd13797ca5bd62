"""The build config: its schema (`build_config`), the names it shares with TensorRT-LLM (`vocab`), and where
a build's outputs live (`workdir`)."""
