#[idem_sdk::plugin(providers = ["email"])]
fn handle<P>(_job: idem_sdk::Job<P>) -> Result<Vec<idem_sdk::Effect>, idem_sdk::JobError> {
    Ok(Vec::new())
}

fn main() {}
