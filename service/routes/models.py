"""``GET /v1/models``: the model names and layouts this service converts (from torch-free tables)."""

from __future__ import annotations

from fastapi import APIRouter

from ckptconv.core.errors import NotFound
from ckptconv.engine.layouts.registry import describe_model, list_models, model_index
from service.schemas.common import problem_responses
from service.schemas.models import ModelDetail, ModelList

router = APIRouter(prefix="/v1", tags=["catalog"])


@router.get("/models", response_model=ModelList, summary="Model names and the layouts each converts between")
async def get_models() -> ModelList:
    return ModelList(models=list_models())


@router.get(
    "/models/{name}",
    response_model=ModelDetail,
    summary="One model: family, formats and key rules",
    responses=problem_responses(404),
)
async def get_model(name: str) -> ModelDetail:
    index = model_index()
    if name not in index:
        raise NotFound(f"unknown model {name!r}", hint="GET /v1/models lists the model names")
    if index[name].unsupported:
        entry = next(m for m in list_models() if m["name"] == name)
        return ModelDetail(**entry)
    return ModelDetail(**describe_model(name))
