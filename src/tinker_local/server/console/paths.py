"""Where the console lives on the server's port: its login form, its static files and its
login cookie. The HTTP edge (`server/http/access.py`) reads these to let a browser in."""

# The console's login cookie, and the console paths served without one (the login form and
# the stylesheet and script it uses).
CONSOLE_COOKIE = "tinker_local_console"
CONSOLE_LOGIN = "/login"
CONSOLE_STATIC = "/console/static/"
