//! Parsing of evaluation specs such as `wiki:8` or `austen-long:2048`.

/// What to evaluate: the protocol is stated in docs/results.md ("Float reference").
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EvalSpec {
    /// The first `windows` non-overlapping windows of `window` tokens of a named text
    /// (`wiki`, `austen/<novel>`, `brown`, or a file path).
    Windows {
        text: String,
        windows: usize,
        window: usize,
    },
    /// For each of the four long novels, the last `context` tokens: prefill all but the final
    /// `scored` tokens, then score those one at a time through the decode path.
    AustenLong { context: usize, scored: usize },
}

pub const DEFAULT_WINDOW: usize = 2048;
pub const LONG_SCORED_TOKENS: usize = 256;
pub const LONG_NOVELS: [&str; 4] = [
    "emma",
    "mansfieldpark",
    "prideprejudice",
    "sensesensibility",
];

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EvalSpecError {
    #[error("evaluation spec '{0}': expected NAME:COUNT, e.g. wiki:8 or austen-long:2048")]
    Syntax(String),
    #[error("evaluation spec '{spec}': {msg}")]
    Value { spec: String, msg: String },
}

impl EvalSpec {
    /// `window` overrides the 2048-token window of windowed texts (`--ctx`).
    pub fn parse(spec: &str, window: Option<usize>) -> Result<Self, EvalSpecError> {
        let (name, count) = spec
            .rsplit_once(':')
            .ok_or_else(|| EvalSpecError::Syntax(spec.to_string()))?;
        let n: usize = count.parse().map_err(|_| EvalSpecError::Value {
            spec: spec.to_string(),
            msg: format!("'{count}' is not a positive integer"),
        })?;
        if n == 0 {
            return Err(EvalSpecError::Value {
                spec: spec.to_string(),
                msg: "count must be at least 1".into(),
            });
        }
        if name == "austen-long" {
            if n <= LONG_SCORED_TOKENS {
                return Err(EvalSpecError::Value {
                    spec: spec.to_string(),
                    msg: format!("context must exceed the {LONG_SCORED_TOKENS} scored tokens"),
                });
            }
            return Ok(EvalSpec::AustenLong {
                context: n,
                scored: LONG_SCORED_TOKENS,
            });
        }
        let window = window.unwrap_or(DEFAULT_WINDOW);
        if window < 2 {
            return Err(EvalSpecError::Value {
                spec: spec.to_string(),
                msg: "window must be at least 2 tokens".into(),
            });
        }
        Ok(EvalSpec::Windows {
            text: name.to_string(),
            windows: n,
            window,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_protocol_specs() {
        assert_eq!(
            EvalSpec::parse("wiki:8", None).unwrap(),
            EvalSpec::Windows {
                text: "wiki".into(),
                windows: 8,
                window: 2048
            }
        );
        assert_eq!(
            EvalSpec::parse("austen-long:2048", None).unwrap(),
            EvalSpec::AustenLong {
                context: 2048,
                scored: 256
            }
        );
        assert_eq!(
            EvalSpec::parse("/tmp/a:b.txt:3", Some(512)).unwrap(),
            EvalSpec::Windows {
                text: "/tmp/a:b.txt".into(),
                windows: 3,
                window: 512
            }
        );
        assert!(EvalSpec::parse("wiki", None).is_err());
        assert!(EvalSpec::parse("wiki:0", None).is_err());
        assert!(EvalSpec::parse("austen-long:100", None).is_err());
    }
}
