"""The one exception type for user mistakes: app.run prints it as a single line, no traceback."""


class UserError(Exception):
    """A problem with the user's input (a file, a config value); the message says what to do."""
