/* A valid shared library that is not a DTK plugin. */
int not_a_plugin(void) { return 42; }
