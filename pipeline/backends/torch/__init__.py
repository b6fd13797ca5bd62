"""The torch backend: HF checkpoint -> runtime-layout checkpoint (`checkpoint.convert`) -> engine
directory (`build.build`) that `pipeline.runtime` loads on CPU or CUDA."""
