"""Offline schema check for Kubernetes manifests, strict like `kubectl apply --validate=strict`.

The schemas are the OpenAPI models that Kubeflow and Kubernetes publish:

- Kubeflow Trainer v2's `kubeflow-trainer-api` (module `kubeflow_trainer_api`, generated from
  Trainer's API: TrainJob with the core types it embeds). Pydantic models: each field has its
  JSON name (`alias`) and a typed annotation (StrictStr, StrictInt, ...). Their `from_dict`
  silently drops fields it does not know, so `errors()` walks the document against the
  annotations itself, then deserializes it with `from_dict` for the models' own validators.
- The Training Operator v1's `kubeflow-training` (PyTorchJob, the legacy recipe) and the
  official Kubernetes Python client (core objects: pods, volumes, claims): every model lists its
  fields (`attribute_map`: JSON name) and their types (`openapi_types`); the constructors reject
  a missing required field.

`errors()` reports every unknown field, wrong type and missing required field, with its path.
"""

import re
import types
import typing

import kubernetes.client.models as core
import pydantic
from kubeflow.training import models as kubeflow
from kubeflow_trainer_api import models as trainer

MODELS = {("kubeflow.org/v1", "PyTorchJob"): "KubeflowOrgV1PyTorchJob",
          ("v1", "PersistentVolumeClaim"): "V1PersistentVolumeClaim",
          ("v1", "ConfigMap"): "V1ConfigMap"}
TRAINER_MODELS = {("trainer.kubeflow.org/v1alpha1", "TrainJob"): trainer.TrainerV1alpha1TrainJob}
SCALARS = {"str": str, "int": int, "bool": bool, "float": (int, float), "datetime": str,
           "date": str}


def model_class(name):
    return getattr(kubeflow, name, None) or getattr(core, name)


def errors(document):
    """Every schema violation in one manifest document, as 'path: problem' lines."""
    key = (document.get("apiVersion"), document.get("kind"))
    if key in TRAINER_MODELS:
        return trainer_errors(document, TRAINER_MODELS[key])
    if key not in MODELS:
        return [f"apiVersion/kind {key}: no schema here "
                f"(known: {sorted([*MODELS, *TRAINER_MODELS])})"]
    found = []
    check(document, MODELS[key], document.get("kind"), found)
    return found


def check(value, type_name, path, found):
    """Check value against an OpenAPI type name; return the constructed value (or None)."""
    if type_name == "object":
        return value
    if type_name in SCALARS:
        expected = SCALARS[type_name]
        if isinstance(value, bool) and type_name != "bool" or not isinstance(value, expected):
            found.append(f"{path}: expected {type_name}, got {type(value).__name__} {value!r}")
        return value
    if inner := re.fullmatch(r"list\[(.+)\]", type_name):
        if not isinstance(value, list):
            found.append(f"{path}: expected a list, got {type(value).__name__}")
            return None
        return [check(item, inner[1], f"{path}[{i}]", found) for i, item in enumerate(value)]
    if inner := re.fullmatch(r"dict\(str, (.+)\)", type_name):
        if not isinstance(value, dict):
            found.append(f"{path}: expected a map, got {type(value).__name__}")
            return None
        return {k: check(v, inner[1], f"{path}.{k}", found) for k, v in value.items()}
    return check_model(value, model_class(type_name), path, found)


def check_model(value, cls, path, found):
    if not isinstance(value, dict):
        found.append(f"{path}: expected an object ({cls.__name__}), got {type(value).__name__}")
        return None
    by_json_name = {json_name: attr for attr, json_name in cls.attribute_map.items()}
    kwargs = {}
    for json_name, child in value.items():
        attr = by_json_name.get(json_name)
        if attr is None:
            found.append(f"{path}.{json_name}: unknown field of {cls.__name__} "
                         f"(known: {', '.join(sorted(by_json_name))})")
            continue
        kwargs[attr] = check(child, cls.openapi_types[attr], f"{path}.{json_name}", found)
    try:
        cls(**kwargs)  # the generated constructor rejects missing required fields
    except ValueError as exc:
        found.append(f"{path}: {exc}")
    return kwargs


# ------------------------------------------------------------ kubeflow_trainer_api (pydantic)
def trainer_errors(document, cls):
    found = []
    check_annotation(document, cls, document["kind"], found)
    if not found:  # the walk saw every field; the models' own validators have the last word
        try:
            cls.from_dict(document)
        except (pydantic.ValidationError, ValueError) as exc:
            found.append(f"{document['kind']}: {exc}")
    return found


def check_annotation(value, annotation, path, found):
    """Check value against a pydantic field annotation: Optional, List, Dict, a model, a oneOf
    wrapper (Quantity, IntOrString) or a scalar such as StrictStr."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if value is None and len(options) < len(args):
            return
        if len(options) == 1:
            return check_annotation(value, options[0], path, found)
    elif origin is list:
        if not isinstance(value, list):
            found.append(f"{path}: expected a list, got {type(value).__name__}")
            return
        for i, item in enumerate(value):
            check_annotation(item, args[0], f"{path}[{i}]", found)
        return
    elif origin is dict:
        if not isinstance(value, dict):
            found.append(f"{path}: expected a map, got {type(value).__name__}")
            return
        for k, v in value.items():
            check_annotation(v, args[1], f"{path}.{k}", found)
        return
    elif isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return check_trainer_model(value, annotation, path, found)
    try:
        pydantic.TypeAdapter(annotation).validate_python(value)
    except pydantic.ValidationError as exc:
        found.append(f"{path}: {exc.errors()[0]['msg']}, got {type(value).__name__} {value!r}")


def check_trainer_model(value, cls, path, found):
    if "actual_instance" in cls.model_fields:  # a oneOf wrapper: a str, or a number, ...
        try:
            cls.from_dict(value)
        except ValueError:
            kinds = sorted(cls.model_fields["one_of_schemas"].default)
            found.append(f"{path}: expected one of {kinds} ({cls.__name__}), "
                         f"got {type(value).__name__} {value!r}")
        return
    if not isinstance(value, dict):
        found.append(f"{path}: expected an object ({cls.__name__}), got {type(value).__name__}")
        return
    fields = {info.alias or name: info for name, info in cls.model_fields.items()}
    for json_name, child in value.items():
        if json_name not in fields:
            found.append(f"{path}.{json_name}: unknown field of {cls.__name__} "
                         f"(known: {', '.join(sorted(fields))})")
            continue
        check_annotation(child, fields[json_name].annotation, f"{path}.{json_name}", found)
    for json_name, info in fields.items():
        if info.is_required() and json_name not in value:
            found.append(f"{path}: missing required field `{json_name}` of {cls.__name__}")
