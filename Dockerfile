# The SYNAPSE web app and its CPU worker. The GPU worker is built from this file too, with torch's
# CUDA build (TORCH_INDEX below), and consumes the `gpu` queue;
# the LLM is a separate OpenAI-compatible server (vLLM) in docker-compose.yml.
FROM python:3.11-slim
# DEBUG off: an image started without SECRET_KEY stops saying so instead of serving debug pages
# signed with the development key (.dockerignore keeps .data, .venv and .git out of the image).
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 DEBUG=0
WORKDIR /app
# torch's CPU build by default; the GPU worker's image is built with a CUDA index instead
# (docker-compose.yml: worker-gpu), so that its tuning task (routing.finetune) runs on the GPU.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install --no-cache-dir torch==2.13.0 --index-url ${TORCH_INDEX}
COPY pyproject.toml README.md ./
COPY synapse_web synapse_web
COPY compendium compendium
COPY routing routing
COPY federation federation
COPY workers workers
RUN pip install --no-cache-dir .
COPY . .
RUN DEBUG=1 SECRET_KEY=build-only DATABASE_URL=postgres://unused/unused python manage.py collectstatic --noinput -v 0
# Build the int8-compute query model once, into the image (otherwise the first query builds it).
RUN python -c "from routing.embeddings import get_query_engine; get_query_engine()"
EXPOSE 8000
CMD ["gunicorn", "synapse_web.wsgi:application", "--bind", "0.0.0.0:8000", "--workers", "4", "--threads", "4"]
