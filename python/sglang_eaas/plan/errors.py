"""The one error the planner's inputs raise."""


class PlanInputError(ValueError):
    """A model, profile, load or traffic input the planner cannot use; the message is one
    sentence naming the file, flag or field to fix."""
