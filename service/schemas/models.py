"""Model names the service converts between Hugging Face and Cerebras Model Zoo layouts."""

from __future__ import annotations

from pydantic import BaseModel, Field


class Model(BaseModel):
    name: str = Field(description="Model Zoo model name, as `--model` / options.model takes it")
    family: str | None = Field(description="the layout table the name uses")
    supported: bool
    description: str | None = None
    headless: bool = False
    formats: list[str] = Field(description="layouts it converts between: hf and cs-X.Y releases")
    hf_architectures: list[str] = Field(default=[], description="Hugging Face class(es) of the model")
    cs_class: str | None = Field(default=None, description="the Cerebras Model Zoo class of the model")
    alias_of: str | None = None
    head: str | None = None
    notes: list[str] = []
    reason: str | None = Field(default=None, description="why an unsupported name cannot be converted")


class ModelList(BaseModel):
    models: list[Model]


class ModelDetail(Model):
    key_rules: list[str] = Field(default=[], description="key patterns, Hugging Face <-> Cerebras")
    dims: dict[str, str | int | float | bool] = {}
