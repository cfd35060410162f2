"""``GET /v1/formats`` and ``GET /v1/kinds``: what this service can read, write and run."""

from __future__ import annotations

from fastapi import APIRouter

from ckptconv.formats import FORMATS
from ckptconv.jobs.kinds import KINDS
from service.schemas.catalog import FormatList, KindList

router = APIRouter(prefix="/v1", tags=["catalog"])


@router.get("/formats", response_model=FormatList, summary="Container formats")
async def list_formats() -> FormatList:
    return FormatList(formats=[f.describe() for f in FORMATS.values()])


@router.get("/kinds", response_model=KindList, summary="Job kinds and their options")
async def list_kinds() -> KindList:
    return KindList(
        kinds=[
            {
                "name": k.name,
                "description": k.description,
                "target": k.target,
                "options_schema": k.options.model_json_schema(),
            }
            for k in KINDS.values()
        ]
    )
