//! Chat templates: the Jinja template shipped in `tokenizer_config.json`, rendered with
//! minijinja the way transformers' `apply_chat_template` renders it.

use minijinja::{context, Environment, Error, ErrorKind};

#[derive(Debug, Clone, serde::Serialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

#[derive(Debug, thiserror::Error)]
#[error("chat template: {0}")]
pub struct ChatTemplateError(String);

/// Renders `messages` with `template`, appending the assistant prompt when
/// `add_generation_prompt` is set.
pub fn render_chat(
    template: &str,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<String, ChatTemplateError> {
    let mut env = Environment::new();
    // transformers renders with trim_blocks and lstrip_blocks.
    env.set_trim_blocks(true);
    env.set_lstrip_blocks(true);
    env.add_function("raise_exception", |msg: String| -> Result<String, Error> {
        Err(Error::new(ErrorKind::InvalidOperation, msg))
    });
    env.add_template("chat", template)
        .map_err(|e| ChatTemplateError(e.to_string()))?;
    let tmpl = env
        .get_template("chat")
        .map_err(|e| ChatTemplateError(e.to_string()))?;
    tmpl.render(context! {
        messages => messages,
        add_generation_prompt => add_generation_prompt,
        bos_token => bos_token,
        eos_token => eos_token,
    })
    .map_err(|e| ChatTemplateError(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_chatml_style_template() {
        let t = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
        let msgs = [ChatMessage {
            role: "user".into(),
            content: "Hi".into(),
        }];
        let s = render_chat(t, &msgs, true, "", "").unwrap();
        assert_eq!(s, "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
    }

    #[test]
    fn raise_exception_is_an_error() {
        let t = "{{ raise_exception('no system role') }}";
        assert!(render_chat(t, &[], false, "", "")
            .unwrap_err()
            .to_string()
            .contains("no system role"));
    }
}
