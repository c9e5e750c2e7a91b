//! Chat templates: the model's `tokenizer_config.json` (its `bos_token`, `eos_token`,
//! `model_max_length` and `chat_template`) and the template rendered with `minijinja` and its
//! Python-compatibility methods (`.strip()`, `.items()`, ... as Hugging Face templates use
//! them), with `raise_exception` and a fuel bound on every render.

use std::path::Path;

use minijinja::{Environment, ErrorKind, Value};
use serde::Serialize;

use crate::error::{ApiError, ServerError};
use crate::protocol::{Content, Message};

/// The most template instructions one render may run (a template looping without end over a
/// client's messages stops here with an error).
const RENDER_FUEL: u64 = 50_000_000;

/// What the server reads from `tokenizer_config.json`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TokenizerConfig {
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub model_max_length: Option<f64>,
    pub chat_template: Option<String>,
}

impl TokenizerConfig {
    /// `dir/tokenizer_config.json`, or an empty config when there is none.
    pub fn from_dir(dir: &Path) -> Result<TokenizerConfig, ServerError> {
        let path = dir.join("tokenizer_config.json");
        let text = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(TokenizerConfig::default());
            }
            Err(e) => {
                return Err(ServerError::Io {
                    what: format!("reading {}", path.display()),
                    source: e,
                });
            }
        };
        let err = |msg: String| ServerError::TokenizerConfig {
            path: path.display().to_string(),
            msg,
        };
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| err(e.to_string()))?;
        // A special token is a string or an AddedToken object with `content`.
        let token = |key: &str| -> Option<String> {
            match v.get(key)? {
                serde_json::Value::String(s) => Some(s.clone()),
                serde_json::Value::Object(o) => o.get("content")?.as_str().map(str::to_string),
                _ => None,
            }
        };
        // A template is a string, or a list of {name, template} of which "default" is taken.
        let chat_template = match v.get("chat_template") {
            None | Some(serde_json::Value::Null) => None,
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(serde_json::Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"))
                .or_else(|| list.first())
                .and_then(|t| t.get("template"))
                .and_then(|t| t.as_str())
                .map(str::to_string),
            Some(other) => {
                return Err(err(format!(
                    "chat_template is neither a string nor a list: {other}"
                )));
            }
        };
        Ok(TokenizerConfig {
            bos_token: token("bos_token"),
            eos_token: token("eos_token"),
            model_max_length: v.get("model_max_length").and_then(|m| m.as_f64()),
            chat_template,
        })
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    pub source: String,
    bos_token: String,
    eos_token: String,
}

#[derive(Serialize)]
struct RenderMessage {
    role: String,
    content: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    name: Option<String>,
}

#[derive(Serialize)]
struct Context<'a> {
    messages: &'a [RenderMessage],
    add_generation_prompt: bool,
    bos_token: &'a str,
    eos_token: &'a str,
}

impl ChatTemplate {
    /// Compiles `source` (a syntax error is a start-up error naming it).
    pub fn new(source: String, config: &TokenizerConfig) -> Result<ChatTemplate, ServerError> {
        let mut env = Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.set_fuel(Some(RENDER_FUEL));
        // Hugging Face renders with these (jinja2's defaults in transformers).
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_template_owned("chat", source.clone())
            .map_err(|e| ServerError::Template(e.to_string()))?;
        Ok(ChatTemplate {
            env,
            source,
            bos_token: config.bos_token.clone().unwrap_or_default(),
            eos_token: config.eos_token.clone().unwrap_or_default(),
        })
    }

    /// The prompt text of `messages` (a template error is the client's 400: templates raise on
    /// message orders they do not support).
    pub fn render(
        &self,
        messages: &[Message],
        add_generation_prompt: bool,
    ) -> Result<String, ApiError> {
        let msgs: Vec<RenderMessage> = messages
            .iter()
            .enumerate()
            .map(|(i, m)| {
                Ok(RenderMessage {
                    role: m.role.clone(),
                    content: content_text(m.content.as_ref(), i)?,
                    name: m.name.clone(),
                })
            })
            .collect::<Result<_, ApiError>>()?;
        let t = self
            .env
            .get_template("chat")
            .map_err(|e| ApiError::internal(format!("the chat template: {e}")))?;
        t.render(Context {
            messages: &msgs,
            add_generation_prompt,
            bos_token: &self.bos_token,
            eos_token: &self.eos_token,
        })
        .map_err(|e| ApiError::bad("messages", format!("rendering the chat template: {e:#}")))
    }
}

/// A message's text: a string, or the text parts of a list joined by newlines.
fn content_text(c: Option<&Content>, i: usize) -> Result<String, ApiError> {
    match c {
        None => Ok(String::new()),
        Some(Content::Text(t)) => Ok(t.clone()),
        Some(Content::Parts(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for p in parts {
                if p.kind != "text" {
                    return Err(ApiError::bad(
                        &format!("messages[{i}].content"),
                        format!(
                            "content part type `{}` is not supported (text only)",
                            p.kind
                        ),
                    ));
                }
                texts.push(p.text.clone().unwrap_or_default());
            }
            Ok(texts.join("\n"))
        }
    }
}

fn raise_exception(msg: String) -> Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
}
