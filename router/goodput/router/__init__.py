"""goodput's request router: one OpenAI endpoint for every InferenceService.

The contract with the autoscaler, the operator and the worker: docs/router-autoscaler-contract.md.
"""
