"""From what the user typed to a checked job: recipes and overrides composed (compose), the model section
typed by its family (model_schema, hf_model), every cross-field rule (ranges, rules/, validate), and the
choices made from sources (tokenizer_choice, reference_run). Above the model families and the data
readers it consults; below the planner, the launcher and the worker that read the job it returns.
"""
