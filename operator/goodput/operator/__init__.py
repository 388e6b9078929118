"""goodput operator: the InferenceService CRD (api, crdgen), pure builders (resources, status) and the
kopf handlers. Run with ``python -m goodput.operator``."""
