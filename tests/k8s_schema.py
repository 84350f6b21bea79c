"""Offline schema check for Kubernetes manifests, strict like `kubectl apply --validate=strict`.

The schemas are the OpenAPI models that Kubeflow publishes in its Training SDK
(`kubeflow-training`, generated from the operator's API: PyTorchJob and its specs) and the
official Kubernetes Python client (core objects: pods, volumes, claims). Every model lists its
fields (`attribute_map`: JSON name) and their types (`openapi_types`); the constructors reject a
missing required field. `errors()` walks a document against them and reports every unknown
field, wrong type and missing required field, with its path.
"""

import re

import kubernetes.client.models as core
from kubeflow.training import models as kubeflow

MODELS = {("kubeflow.org/v1", "PyTorchJob"): "KubeflowOrgV1PyTorchJob",
          ("v1", "PersistentVolumeClaim"): "V1PersistentVolumeClaim",
          ("v1", "ConfigMap"): "V1ConfigMap"}
SCALARS = {"str": str, "int": int, "bool": bool, "float": (int, float), "datetime": str,
           "date": str}


def model_class(name):
    return getattr(kubeflow, name, None) or getattr(core, name)


def errors(document):
    """Every schema violation in one manifest document, as 'path: problem' lines."""
    key = (document.get("apiVersion"), document.get("kind"))
    if key not in MODELS:
        return [f"apiVersion/kind {key}: no schema here (known: {sorted(MODELS)})"]
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
