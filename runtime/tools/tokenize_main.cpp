// refit-tokenize --tokenizer PATH [--decode] [--skip-special-tokens]
// Reads JSON lines on stdin: {"text": ...} -> prints {"ids": [...]}; with --decode reads
// {"ids": [...]} -> prints {"text": ...}. A bad line is reported on stderr with its line
// number and the exit status is 1.
#include <iostream>
#include <string>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "runtime/tokenizer/tokenizer.hpp"

int main(int argc, char** argv) {
  CLI::App app{"Encode or decode JSON lines with an HF tokenizer.json"};
  std::string path;
  bool decode = false, skip_special = false;
  app.add_option("--tokenizer", path, "tokenizer.json or its directory")->required();
  app.add_flag("--decode", decode, "read {\"ids\": [...]}, print {\"text\": ...}");
  app.add_flag("--skip-special-tokens", skip_special, "decode without special tokens");
  CLI11_PARSE(app, argc, argv);

  std::optional<refit::tokenizer::tokenizer> tok;
  try {
    tok.emplace(refit::tokenizer::tokenizer::load(path));
  } catch (const std::exception& e) {
    std::cerr << "refit-tokenize: " << e.what() << "\n";
    return 1;
  }
  std::string line;
  std::size_t lineno = 0;
  while (std::getline(std::cin, line)) {
    ++lineno;
    try {
      auto in = nlohmann::json::parse(line);
      if (!in.is_object())
        throw std::runtime_error("expected a JSON object");
      nlohmann::json out;
      if (decode) {
        auto it = in.find("ids");
        if (it == in.end() || !it->is_array())
          throw std::runtime_error("missing array field \"ids\"");
        std::vector<std::int32_t> ids;
        for (const auto& v : *it) {
          if (!v.is_number_integer() || v.get<std::int64_t>() < INT32_MIN ||
              v.get<std::int64_t>() > INT32_MAX)
            throw std::runtime_error("\"ids\" must hold 32-bit integers");
          ids.push_back(static_cast<std::int32_t>(v.get<std::int64_t>()));
        }
        out["text"] = tok->decode(ids, skip_special);
      } else {
        auto it = in.find("text");
        if (it == in.end() || !it->is_string())
          throw std::runtime_error("missing string field \"text\"");
        out["ids"] = tok->encode(it->get_ref<const std::string&>());
      }
      std::cout << out.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) << "\n";
    } catch (const std::exception& e) {
      std::cerr << "refit-tokenize: stdin line " << lineno << ": " << e.what() << "\n";
      return 1;
    }
  }
  std::cout.flush();
  return std::cout ? 0 : 1;
}
