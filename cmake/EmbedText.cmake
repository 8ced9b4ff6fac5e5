# Writes ${OUT}: a C++ source defining refit::config::embedded_default_yaml() from ${IN}.
file(READ "${IN}" _text)
set(_delim "REFIT_EMBED")
file(WRITE "${OUT}" "// generated from ${IN}; do not edit\n#include <string>\nnamespace refit::config {\nconst std::string& embedded_default_yaml() {\n  static const std::string text = R\"${_delim}(${_text})${_delim}\";\n  return text;\n}\n} // namespace refit::config\n")
