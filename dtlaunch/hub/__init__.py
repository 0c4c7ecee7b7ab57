"""Hugging Face Hub names: `model.init_from=hf:ORG/NAME[@REVISION]`, `data.kind=hf data.path=ORG/NAME`
and `dtlaunch download`. huggingface_hub is imported only here, and only when a hub name is used."""
